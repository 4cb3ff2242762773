"""The one reader of raw config (a JSON path or a dict): aliases, "auto", DeepSpeed-only keys, the
batch-size triangle, and user-facing error messages with "did you mean" suggestions.

Runs identically on every rank before the first collective, so a bad config fails everywhere.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import types
import typing
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

from . import deepspeed_keys as ds_keys
from .errors import ConfigError
from .sections import Config

logger = logging.getLogger(__name__)
_warned: set[str] = set()

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def load_raw(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of the user's dict, or the parsed JSON file."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = Path(config)
    if not path.is_file():
        raise ConfigError([f"config: file not found: {str(path)!r}. Pass a path to a JSON file or a dict."])
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError([f"config {str(path)!r}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}."]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"config {str(path)!r}: the top level must be a JSON object; got {type(raw).__name__}."])
    return raw


def parse_config(config: str | Path | Mapping[str, Any], dp_size: int = 1) -> Config:
    """Validate a raw config for `dp_size` data-parallel ranks and return the typed, frozen Config."""
    raw = load_raw(config)
    problems: list[str] = []
    _apply_aliases(raw)
    _apply_zero_flag_aliases(raw)
    _drop_auto(raw)
    _normalise_names(raw)
    _strip_deepspeed_only(raw, problems)
    batch_problems = _solve_batch(raw, dp_size)
    problems += batch_problems
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        if batch_problems:  # the batch message already says what is missing
            errors = [err for err in errors if not (err["type"] == "missing" and err["loc"][0] in BATCH_KEYS)]
        problems += [_explain(err) for err in errors]
        cfg = None
    if problems:
        raise ConfigError(problems)
    assert cfg is not None
    return cfg


def config_json_schema() -> dict[str, Any]:
    """JSON schema of the config, for editors."""
    return Config.model_json_schema()


def _apply_zero_flag_aliases(raw: dict[str, Any]) -> None:
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    for flag, section in ds_keys.ZERO_FLAG_ALIASES.items():
        if flag in zero:
            value = zero.pop(flag)
            if value is True:
                zero.setdefault(section, {"device": "cpu"})


def _apply_aliases(raw: dict[str, Any]) -> None:
    for alias, target in ds_keys.ROOT_ALIASES.items():
        if alias not in raw:
            continue
        value = raw.pop(alias)
        *parents, leaf = target.split(".")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
        node.setdefault(leaf, value)


def _drop_auto(node: Any) -> None:
    """"auto" (what Hugging Face's Trainer writes) means "derive it or use the default": drop the key."""
    if isinstance(node, dict):
        for key in [k for k, v in node.items() if v == "auto"]:
            del node[key]
        for value in node.values():
            _drop_auto(value)


def _normalise_names(raw: dict[str, Any]) -> None:
    # DeepSpeed matches optimizer names case-insensitively ("Adam", "adamw").
    opt = raw.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("type"), str):
        opt["type"] = opt["type"].lower()


def _strip_deepspeed_only(raw: dict[str, Any], problems: list[str]) -> None:
    _strip(raw, ds_keys.ROOT_KEYS, "", problems)
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        _strip(zero, ds_keys.ZERO_KEYS, "zero_optimization.", problems)


def _strip(node: dict[str, Any], table: dict[str, str], prefix: str, problems: list[str]) -> None:
    for key in [k for k in node if k in table]:
        value = node.pop(key)
        path = prefix + key
        if ds_keys.is_switched_off(value):
            continue
        if table[key] == ds_keys.CHANGES_TRAINING:
            problems.append(
                f"{path}: a DeepSpeed setting that shardwise does not implement yet; it changes what is "
                f"trained or where memory goes, so it is refused rather than ignored; got {value!r}. "
                "Remove it (or set it to disabled) to train without it."
            )
        elif path not in _warned:
            _warned.add(path)
            logger.warning("%s: a DeepSpeed setting that shardwise does not act on yet; ignored.", path)


def _solve_batch(raw: dict[str, Any], dp_size: int) -> list[str]:
    """Fill in the one missing key of train = micro × accumulation × dp (DeepSpeed's arithmetic)."""
    given = {k: raw[k] for k in BATCH_KEYS if k in raw}
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in given.values()):
        return []  # the type/range error is reported by validation with the key path
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
        # Derive the missing one; with train_batch_size alone, accumulation defaults to 1.
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


def _explain(err: Mapping[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"]) or "config"
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_key(err["loc"], path)
    if kind == "missing":
        return f"{path}: required; it is missing. Add it to the config."
    if kind == "value_error":
        return str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
    if kind == "literal_error":
        return _not_a_choice(path, err["input"], err["ctx"]["expected"])
    msg = err["msg"][0].lower() + err["msg"][1:]
    return f"{path}: {msg}; got {err['input']!r}."


def _not_a_choice(path: str, value: Any, expected: str) -> str:
    choices = [c.strip(" '") for c in expected.replace(" or ", ", ").split(",")]
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(str(value).lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f" Did you mean '{by_lower[close[0]]}'?" if close else ""
    return f"{path}: must be one of {', '.join(choices)}; got {value!r}.{hint}"


def _unknown_key(loc: tuple[Any, ...], path: str) -> str:
    known = sorted(_fields_at(loc[:-1]))
    where = ".".join(str(p) for p in loc[:-1]) or "the top level"
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    hint = f"Did you mean '{close[0]}'? " if close else ""
    return f"{path}: unknown key. {hint}Keys allowed in {where}: {', '.join(known)}."


def _fields_at(loc: tuple[Any, ...]) -> set[str]:
    model: type[BaseModel] = Config
    for part in loc:
        nested = _section_type(model.model_fields[str(part)].annotation)
        if nested is None:
            return set()
        model = nested
    return set(model.model_fields)


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside `X`, `X | None` or `Optional[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _section_type(arg)
            if found is not None:
                return found
    return None
