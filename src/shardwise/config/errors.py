"""The error a user sees for a bad config: the key path, the value, what is allowed, a fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is missing, unknown, out of range or inconsistent. Lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        if len(problems) == 1:
            super().__init__(problems[0])
        else:
            super().__init__(f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems))
