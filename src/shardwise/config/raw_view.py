"""Read access to the config exactly as the user wrote it, as DeepSpeed's `engine.config` dict gives it.

Scripts written for DeepSpeed (and Hugging Face's Trainer) read `engine.config.get("zero_optimization",
{}).get("stage")`. shardwise's `Config` is a typed, frozen object; this mixin adds the dict reads over
the raw dict the parser was given (before "auto" and aliases were resolved, as DeepSpeed keeps it), so
one object serves both: typed fields for shardwise, `get` / `[]` / `in` / `keys` for DeepSpeed code.
"""

from __future__ import annotations

from typing import Any, ItemsView, KeysView, ValuesView


class RawConfigView:
    """Mixed into `Config`, which declares the private `_raw` dict that `parse_config` fills."""

    _raw: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self._raw.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self._raw[key]

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def keys(self) -> KeysView[str]:
        return self._raw.keys()

    def items(self) -> ItemsView[str, Any]:
        return self._raw.items()

    def values(self) -> ValuesView[Any]:
        return self._raw.values()
