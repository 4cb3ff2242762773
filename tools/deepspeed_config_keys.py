"""Extract every config key DeepSpeed reads, from DeepSpeed itself, into a JSON catalogue.

Run with DeepSpeed importable (it is a reference, never a dependency of shardwise):

    DS_ACCELERATOR=cpu /work/main/.dsvenv/bin/python tools/deepspeed_config_keys.py --write
    DS_ACCELERATOR=cpu /work/main/.dsvenv/bin/python tools/deepspeed_config_keys.py --check

How keys are found, without reading DeepSpeed's source by hand:
- Dict-read sections: `DeepSpeedConfig` is built from a config whose sections are `Probe` dicts that
  record every key looked up in them (`get`, `[]`, `in`). Each key found is probed in turn (as an
  empty section, as `{"enabled": true}` and as `true`), until nothing new is read.
- Pydantic sections: a probe section carries a marker; `DeepSpeedConfigModel.__init__` is wrapped to
  note which model class received it, and that class's fields (with their aliases and deprecated
  spellings) are walked, nested models included.
- A few keys are read outside `DeepSpeedConfig` (by `deepspeed.initialize` and the pipeline engine);
  `EXTRA_KEYS` lists them with where they are read.

Each entry carries DeepSpeed's default and a `sample`: a valid, preferably non-default value that
`--write` checks DeepSpeedConfig accepts (keys DeepSpeed 0.19.8 removed and refuses are marked
`removed` and not checked). tests/unit/test_config_keys.py feeds every key to shardwise's parser.
"""

from __future__ import annotations

import argparse
import collections.abc
import copy
import enum
import json
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any

from deepspeed_config_samples import CODE_ONLY, CONTEXT, SAMPLES  # noqa: E402 - the tool's own data, beside it

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "deepspeed_0_19_8_config_keys.json"
MARK = "__probe__"
BASE = {"train_micro_batch_size_per_gpu": 1}

# Read outside DeepSpeedConfig: (path, default, where).
EXTRA_KEYS = [
    ("sequence_parallel_size", None, "deepspeed/__init__.py initialize(): mesh from the config"),
    ("data_parallel_size", None, "deepspeed/__init__.py initialize(): mesh from the config"),
    ("pipeline.use_reentrant", True, "deepspeed/runtime/pipe/engine.py"),
]


class _Keys(collections.abc.KeysView):
    def __contains__(self, key: object) -> bool:
        return key in self._mapping


class Probe(dict):
    """A config section that records each key DeepSpeed looks up in it."""

    def __init__(self, path: tuple[str, ...], log: dict, content: dict | None = None, marked: bool = True):
        super().__init__(content or {})
        if marked:
            dict.__setitem__(self, MARK, ".".join(path))
        self.path, self.log = path, log

    def _seen(self, key: object, default: object = "<no default>") -> None:
        if isinstance(key, str) and key != MARK:
            self.log.setdefault((*self.path, key), default)

    def get(self, key, default=None):
        self._seen(key, default)
        return super().get(key, default)

    def __getitem__(self, key):
        self._seen(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._seen(key)
        return super().__contains__(key)

    def keys(self):
        return _Keys(self)


def _explore(ds: Any) -> tuple[dict, dict]:
    """Keys read through dicts ({path: default}) and pydantic sections ({path: model class})."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    log: dict = {}
    models: dict[str, type] = {}
    original = DeepSpeedConfigModel.__init__

    def init(self, strict=False, **data):
        if MARK in data:
            models[data.pop(MARK)] = type(self)
        for name, value in list(data.items()):
            if isinstance(value, dict) and MARK in value:
                models[value[MARK]] = _model_of(_field(type(self), name).annotation)
                data[name] = {k: v for k, v in value.items() if k != MARK}
        original(self, strict=strict, **data)

    DeepSpeedConfigModel.__init__ = init
    try:
        probed: set = set()
        _run(ds, Probe((), log, dict(BASE), marked=False))
        while True:
            todo = [p for p in log if p not in probed and ".".join(p[:-1]) not in models and p[0] not in BASE]
            if not todo:
                break
            for path in todo:
                probed.add(path)
                for variant in (lambda: Probe(path, log), lambda: Probe(path, log, {"enabled": True}), lambda: True,
                                lambda: "probe"):
                    _run(ds, _nest(Probe((), log, dict(BASE), marked=False), path, variant()))
    finally:
        DeepSpeedConfigModel.__init__ = original
    return log, models


def _nest(root: Probe, path: tuple[str, ...], value: Any) -> Probe:
    node = root
    for i, part in enumerate(path[:-1]):
        node = dict.setdefault(node, part, Probe(path[:i + 1], root.log))
    dict.__setitem__(node, path[-1], value)
    return root


def _run(ds: Any, config: dict) -> None:
    try:
        ds.DeepSpeedConfig(config)
    except Exception:  # a probe is rarely a valid value; the keys it read are what we want
        pass


def _field(model: type, name: str) -> Any:
    for field_name, field in model.model_fields.items():
        if name in (field_name, field.alias):
            return field
    raise KeyError(name)


def _model_of(annotation: Any) -> type | None:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if (found := _model_of(arg)) is not None:
                return found
    return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        return str(value)
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _walk_model(model: type, prefix: str, entries: dict) -> None:
    from pydantic_core import PydanticUndefined

    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        default = field.default_factory() if field.default_factory else field.default
        default = None if default is PydanticUndefined else default
        nested = _model_of(field.annotation)
        entry = {"default": _jsonable(default.model_dump() if hasattr(default, "model_dump") else default),
                 "type": _type_name(field.annotation), "source": f"{model.__module__}.{model.__qualname__}"}
        if extra.get("deprecated"):
            entry["deprecated"] = f"use {extra['new_param']}" if extra.get("new_param") else "deprecated"
        if nested is not None:
            entry["type"] = "section"
            _walk_model(nested, prefix + name + ".", entries)
        entries[prefix + name] = entry
        if field.alias and field.alias != name:
            entries[prefix + field.alias] = {**entry, "alias_of": prefix + name}


def _type_name(annotation: Any) -> str:
    text = repr(annotation) if typing.get_origin(annotation) else getattr(annotation, "__name__", repr(annotation))
    return text.replace("typing.", "")


def catalogue() -> dict[str, dict[str, Any]]:
    import deepspeed.runtime.config as ds

    log, models = _explore(ds)
    entries: dict[str, dict[str, Any]] = {}
    for path, default in log.items():
        dotted = ".".join(path)
        entries[dotted] = {"default": None if default == "<no default>" else _jsonable(default),
                           "type": "section" if dotted in models or any(".".join(p[:-1]) == dotted for p in log)
                           else type(default).__name__ if default not in (None, "<no default>") else "any",
                           "source": "deepspeed.runtime.config.DeepSpeedConfig (dict read)"}
    for path, model in models.items():
        if model is not None:
            entries.setdefault(path, {"default": {}, "source": "", "type": "section"})["type"] = "section"
            _walk_model(model, path + ".", entries)
    for key, default in ds.get_pipeline_config({}).items():  # read as a whole with .items()
        entries[f"pipeline.{key}"] = {"default": default, "type": type(default).__name__,
                                      "source": "deepspeed.runtime.config.get_pipeline_config"}
    for path, default, where in EXTRA_KEYS:
        entries[path] = {"default": default, "type": type(default).__name__ if default is not None else "any", "source": where}
    removed = {**ds._REMOVED_TOP_LEVEL_CONFIG_KEYS,
               **{f"zero_optimization.{k}": v for k, v in ds._REMOVED_ZERO_CONFIG_KEYS.items()}}
    for path, message in removed.items():
        entries[path]["removed"] = message
        entries[path]["type"] = "removed"
    entries.pop(MARK, None)
    for path, entry in entries.items():
        if path in CODE_ONLY:
            entry["code_only"] = True
        entry["sample"] = None if path in CODE_ONLY else _sample(path, entry)
        if path in CONTEXT:
            entry["context"] = CONTEXT[path]
    return dict(sorted(entries.items()))


def _sample(path: str, entry: dict[str, Any]) -> Any:
    if path in SAMPLES:
        return SAMPLES[path]
    default, kind = entry["default"], entry["type"]
    if kind == "removed":
        return {"enabled": True}
    if kind == "section":
        return {}
    if isinstance(default, bool) or kind in ("bool", "Optional[bool]"):
        return not default
    if isinstance(default, int):
        return default * 2 if default else 1
    if isinstance(default, float):
        return default / 2 if default else 0.5
    if isinstance(default, (str, list, dict)):
        return default
    return None  # no sample: --write reports it


def check_samples(entries: dict[str, dict[str, Any]]) -> list[str]:
    """Each sample, in a config of its own, must be accepted by DeepSpeedConfig."""
    import deepspeed.runtime.config as ds

    problems = []
    for path, entry in entries.items():
        if "removed" in entry or "code_only" in entry or entry["source"].startswith(("deepspeed/", "deepspeed.runtime.pipe")):
            continue
        if entry["sample"] is None and entry["default"] is not None:
            problems.append(f"{path}: no sample value; add one to SAMPLES")
            continue
        config = build_config(path, entry["sample"], entry.get("context"))
        try:
            ds.DeepSpeedConfig(config)
        except Exception as e:  # noqa: BLE001 - any refusal is reported
            problems.append(f"{path} = {entry['sample']!r}: DeepSpeed refuses it: {type(e).__name__}: {e}"[:300])
    return problems


def build_config(path: str, value: Any, context: dict | None = None, base: dict | None = None) -> dict:
    """A config with `path` set to `value`, on top of `base` and `context` (shared with the tests)."""
    config = copy.deepcopy(base if base is not None else BASE)
    _merge(config, copy.deepcopy(context or {}))
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = copy.deepcopy(value)
    return config


def _merge(into: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {OUT.name}")
    parser.add_argument("--check", action="store_true", help=f"fail if {OUT.name} differs from DeepSpeed")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # DeepSpeed logs each probe's complaints
    import deepspeed

    entries = catalogue()
    doc = {"deepspeed_version": deepspeed.__version__, "keys": entries}
    problems = check_samples(entries)
    for p in problems:
        print(p, file=sys.stderr)
    if args.write and not problems:
        OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(entries)} keys to {OUT}")
    if args.check:
        stored = json.loads(OUT.read_text())
        if stored != json.loads(json.dumps(doc, sort_keys=True)):
            print(f"{OUT} is out of date; rerun with --write", file=sys.stderr)
            return 1
        print(f"{OUT.name}: {len(entries)} keys, up to date")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
