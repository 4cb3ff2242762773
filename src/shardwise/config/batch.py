"""The batch-size triangle: train = micro × accumulation × data-parallel size (DeepSpeed's arithmetic).

Any two of the three keys give the third; `train_batch_size` alone means no accumulation. Each value
must be a whole number: a float with nothing after the point (8.0, what JSON written by other tools
often holds) counts as one, as it does in DeepSpeed; a boolean or a string never does.
"""

from __future__ import annotations

import json
from typing import Any

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def solve_batch(raw: dict[str, Any], dp_size: int) -> list[str]:
    """Fill in the missing keys of the triangle in `raw`; the problems found (none if it adds up)."""
    given, problems = _whole_numbers(raw)
    if problems:
        return problems
    train, micro, accum = (given.get(k) for k in BATCH_KEYS)
    if micro is not None and accum is not None:
        derived = micro * accum * dp_size
        if train is not None and train != derived:
            return [
                f"train_batch_size ({train}) != train_micro_batch_size_per_gpu ({micro}) × "
                f"gradient_accumulation_steps ({accum}) × data-parallel size ({dp_size}) = {derived}; "
                "drop one of the three keys to have it derived."
            ]
        train = derived
    elif train is not None:
        if micro is not None:
            fixed_name, fixed = "train_micro_batch_size_per_gpu", micro
        else:
            fixed_name, fixed = "gradient_accumulation_steps", accum if accum is not None else 1
        if train % (fixed * dp_size):
            return [
                f"train_batch_size ({train}) is not divisible by {fixed_name} ({fixed}) × data-parallel size "
                f"({dp_size}) = {fixed * dp_size}; choose a train_batch_size that is a multiple of {fixed * dp_size}."
            ]
        other = train // (fixed * dp_size)
        micro, accum = (other, fixed) if fixed_name == "gradient_accumulation_steps" else (fixed, other)
    elif micro is not None:
        accum = 1
        train = micro * dp_size
    else:
        return [
            "train_batch_size / train_micro_batch_size_per_gpu: at least one is required; got neither. "
            'Add e.g. "train_micro_batch_size_per_gpu": 8.'
        ]
    raw.update(train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum)
    return []


def _whole_numbers(raw: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    """The given batch keys as ints (null counts as not given, as in DeepSpeed), or what is wrong with them."""
    given, problems = {}, []
    for key in BATCH_KEYS:
        value = raw.get(key)
        if value is None:
            raw.pop(key, None)
            continue
        if isinstance(value, float) and value.is_integer():
            value = raw[key] = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                problems.append(f"{key}: must be at least 1; got {value}.")
            given[key] = value
            continue
        unit = "micro-steps" if key == "gradient_accumulation_steps" else "samples"
        problems.append(f"{key}: a whole number of {unit}, at least 1, is required; got {_shown(value)}{_what(value)}. "
                        f"{_fix(value)}")
    return given, problems


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, str, int, float)) else repr(value)


def _what(value: Any) -> str:
    return " (a boolean)" if isinstance(value, bool) else " (a string)" if isinstance(value, str) else ""


def _fix(value: Any) -> str:
    if isinstance(value, str):
        try:
            return f"Write it without quotes: {int(float(value))}." if float(value).is_integer() else "Write a whole number."
        except ValueError:
            pass
    if isinstance(value, float):
        return "Write a whole number."
    return "Write a number, e.g. 8."
