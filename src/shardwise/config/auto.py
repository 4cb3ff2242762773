""""auto" values: a placeholder Hugging Face's Trainer and accelerate replace before they call
initialize, so one that reaches shardwise was written by a user.

Where its meaning is unambiguous it is kept (`deepspeed_keys.Treatment.auto`): the batch-size keys are
derived from the others, bucket sizes and thresholds take DeepSpeed's default (what DeepSpeed itself
does with "auto" there), and a no-op key ignores any value. Everywhere else guessing would change the
numerics (lr, betas, clipping, precision, ...): every such key is listed in one error.
"""

from __future__ import annotations

from typing import Any

from . import deepspeed_keys as ds

AUTO = "auto"
PLACEHOLDER = ('"auto" is a placeholder that Hugging Face\'s Trainer/accelerate fill in from TrainingArguments; '
               "outside them give a value or remove the key")


def resolve_auto(raw: dict[str, Any], problems: list[str]) -> list[str]:
    """Drop the "auto" values that have a meaning; report the others. Returns the dropped keys' paths."""
    dropped: list[str] = []
    refused: list[str] = []
    _walk(raw, "", dropped, refused)
    if refused:
        problems.append(f"{', '.join(refused)}: {PLACEHOLDER}; got \"auto\".")
    return dropped


def accepts_auto(path: str) -> bool:
    """Whether "auto" at the dotted key `path` is accepted (derived, defaulted or ignored), as `resolve_auto`
    decides. The config's JSON schema (`schema.py`) allows "auto" there, and where it is a value in its own right."""
    return _verdict(path) == "drop"


def _walk(node: dict[str, Any], prefix: str, dropped: list[str], refused: list[str]) -> None:
    for key in list(node):
        path, value = prefix + key, node[key]
        if isinstance(value, dict):
            _walk(value, path + ".", dropped, refused)
        elif value == AUTO:
            verdict = _verdict(path)
            if verdict == "drop":
                del node[key]
                dropped.append(path)
            elif verdict == "refuse":
                del node[key]  # reported here; validation would only repeat it
                refused.append(path)


def _verdict(path: str) -> str:
    """"drop" (derive or default), "refuse", or "keep" (a value in its own right, or a key the table does
    not know: validation reports it)."""
    treatment = _owner(path)
    if treatment is None:
        return "keep"
    if treatment.accepts is not None:
        return "keep"  # "auto" is a real value there (data_types.keep_in_fp32_modules) or refused as such
    if treatment.auto is not None or treatment.kind in (ds.NO_OP, ds.WARNED):
        return "drop"
    if treatment.kind == ds.REFUSED:
        return "keep"  # the section is refused (or switched off) as a whole
    return "refuse"


def _owner(path: str) -> ds.Treatment | None:
    """The treatment of `path`, else of its nearest section (`optimizer.params.lr` -> `optimizer.params`)."""
    parts = ds.canonical(path).split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        found = ds.TABLE.get(head) if i < len(parts) else ds.lookup(head)
        if found is not None:
            return found
    return None
