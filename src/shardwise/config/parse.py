"""The one reader of raw config (a JSON path or a dict): DeepSpeed's spellings and keys, "auto", the
batch-size triangle, and user-facing error messages with "did you mean" suggestions.

Runs identically on every rank before the first collective, so a bad config fails everywhere. Every
problem found is reported at once.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import types
import typing
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

from .auto import resolve_auto
from .batch import BATCH_KEYS, solve_batch
from .compat import apply_spellings, drop_untyped, section_type, strip_deepspeed_only
from .errors import ConfigError
from .notes import note_once_per_job
from .sections import Config

logger = logging.getLogger("shardwise.config")


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
    as_given = copy.deepcopy(raw)
    problems: list[str] = []
    apply_spellings(raw, problems)
    autos = resolve_auto(raw, problems)
    _check_data_parallel_size(raw, dp_size, problems)
    strip_deepspeed_only(raw, Config, problems)
    drop_untyped(raw)
    problems += _bools_for_numbers(raw, Config, "")
    batch_problems = solve_batch(raw, dp_size)
    problems += batch_problems
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        if batch_problems:  # the batch message already says what is wrong with these keys
            errors = [err for err in errors if not (err["loc"] and err["loc"][0] in BATCH_KEYS)]
        problems += [_explain(err) for err in errors]
        cfg = None
    if problems:
        raise ConfigError(problems)
    assert cfg is not None
    if autos:
        _note_autos(cfg, autos)
    cfg._raw = as_given
    return cfg


def _check_data_parallel_size(raw: dict[str, Any], dp_size: int, problems: list[str]) -> None:
    given = raw.pop("data_parallel_size", None)
    if given is not None and given != dp_size:
        problems.append(f"data_parallel_size: must equal the number of data-parallel ranks ({dp_size}); got {given!r}. "
                        "Remove the key (it is derived from the world size).")


def _bools_for_numbers(node: dict[str, Any], model: type[BaseModel], prefix: str) -> list[str]:
    """pydantic reads true as 1 for a number field; a boolean there is a mistake (e.g. "stage": true)."""
    problems = []
    for key, value in list(node.items()):
        field = model.model_fields.get(key)
        if field is None:
            continue
        nested = section_type(field.annotation)
        if nested is not None and isinstance(value, dict):
            problems += _bools_for_numbers(value, nested, prefix + key + ".")
        elif isinstance(value, bool) and _is_number_field(field.annotation) and prefix + key not in BATCH_KEYS:
            del node[key]  # validation would read it as 1
            example = f", e.g. {field.default!r}" if isinstance(field.default, (int, float)) else ""
            problems.append(f"{prefix}{key}: a number is required; got {str(value).lower()} (a boolean). Write the number{example}.")
    return problems


def _is_number_field(annotation: Any) -> bool:
    arms = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    return bool(arms) and any(a in (int, float) for a in arms) and bool not in arms


def _note_autos(cfg: Config, paths: list[str]) -> None:
    used = []
    for path in paths:
        value: Any = cfg
        for part in _field_path(path):
            value = getattr(value, part, None)
        how = "derived" if path in BATCH_KEYS else "DeepSpeed's default"
        used.append(f"{path}={'inf' if value == math.inf else value} ({how})")
    note_once_per_job(logger, logging.INFO, f'config: "auto" resolved: {", ".join(used)}.')


def _field_path(path: str) -> list[str]:
    from .deepspeed_keys import canonical

    return canonical(path).split(".")


def _explain(err: Mapping[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"]) or "config"
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_key(err["loc"], path)
    if kind == "missing":
        return f"{path}: required; it is missing. Add it to the config."
    if kind == "value_error":
        message = str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
        return _with_path(err["loc"], message)
    if kind == "literal_error":
        return _not_a_choice(path, err["input"], err["ctx"]["expected"])
    msg = err["msg"][0].lower() + err["msg"][1:]
    return f"{path}: {msg}; got {err['input']!r}."


def _with_path(loc: tuple[Any, ...], message: str) -> str:
    """The data-efficiency sections' validator messages name their key relative to the section; give the
    whole path (`data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen.schedule_config`)."""
    if not loc or loc[0] not in ("curriculum_learning", "data_efficiency"):
        return message
    path = [str(p) for p in loc]
    key = message.split(":", 1)[0].split(".", 1)[0]
    if key == path[-1]:
        path = path[:-1]
    return ".".join([*path, message]) if path else message


def _not_a_choice(path: str, value: Any, expected: str) -> str:
    choices = [c.strip(" '") for c in expected.replace(" or ", ", ").split(",")]
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(str(value).lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f" Did you mean '{by_lower[close[0]]}'?" if close else ""
    return f"{path}: must be one of {', '.join(choices)}; got {value!r}.{hint}"


def _unknown_key(loc: tuple[Any, ...], path: str) -> str:
    known = sorted(_fields_at(loc[:-1]))
    where = ".".join(str(p) for p in loc[:-1]) or "the top level"
    close = difflib.get_close_matches(str(loc[-1]), known + _deepspeed_keys_at(loc[:-1]), n=1, cutoff=0.6)
    hint = f"Did you mean '{close[0]}'? " if close else ""
    return f"{path}: unknown key. {hint}Keys allowed in {where}: {', '.join(known)}."


def _deepspeed_keys_at(loc: tuple[Any, ...]) -> list[str]:
    """DeepSpeed's own spellings at this level (accepted too, so worth suggesting)."""
    from .deepspeed_keys import ALIASES, TABLE

    prefix = "".join(f"{p}." for p in loc)
    names = {k[len(prefix):].removesuffix(".*") for k in [*TABLE, *ALIASES] if k.startswith(prefix)}
    return sorted(n for n in names if n and "." not in n)


def _fields_at(loc: tuple[Any, ...]) -> set[str]:
    model: type[BaseModel] = Config
    for part in loc:
        nested = section_type(model.model_fields[str(part)].annotation)
        if nested is None:
            return set()
        model = nested
    return set(model.model_fields)
