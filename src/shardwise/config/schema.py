"""The config's JSON schema, for editors (`shardwise config schema`): what `parse.py` accepts, no less.

It starts from the pydantic models' schema (`sections.py`) and adds what the parser takes before the
models see the config: DeepSpeed's keys that are not shardwise fields (`deepspeed_keys.TABLE`: no-ops take
any value, limited keys their accepted values, refused sections only when switched off), DeepSpeed's other
spellings (`ALIASES`), "auto" wherever `auto.resolve_auto` accepts it, and the spellings the validators
normalize (any-case dtype and tag names, null for "not given", `zero_optimization: true`). A key the parser
does not know is refused here too (`additionalProperties: false`), so an editor flags a typo.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from . import deepspeed_keys as ds
from .auto import AUTO, accepts_auto
from .batch import BATCH_KEYS
from .mixed_precision import DTYPE_NAMES
from .monitoring import OP_ALIASES
from .sections import Config
from .training import OPTIMIZER_NAMES, SCHEDULER_NAMES

Schema = dict[str, Any]
DRAFT = "https://json-schema.org/draft/2020-12/schema"
# Keys the parser reads itself (not fields of a section): their values. The old offload flags are read
# before "auto" is resolved: anything but true means off.
_OLD_FLAG: Schema = {"enum": [True, False, None, AUTO]}
_PARSER_KEYS: dict[str, Schema] = {
    "data_parallel_size": {"type": ["integer", "null"], "minimum": 1},
    "zero_optimization.cpu_offload": _OLD_FLAG,
    "zero_optimization.cpu_offload_param": _OLD_FLAG,
    "zero_optimization.cpu_offload_use_pin_memory": _OLD_FLAG,
}


def config_json_schema() -> Schema:
    """JSON schema (draft 2020-12) of a shardwise / DeepSpeed config file."""
    generated = Config.model_json_schema()
    root = _inline(generated, generated.pop("$defs", {}))
    for path in sorted(ds.TABLE, key=lambda p: p.removesuffix(".*").count(".")):  # sections before their keys
        _add_table_key(root, path, ds.TABLE[path])
    for alias, target in ds.ALIASES.items():
        _add_alias(root, alias, target)
    _spellings(root)
    _allow_auto(root, "")
    _offload_param_below_stage3(_section(root["properties"]["zero_optimization"]))
    root.update(title="shardwise / DeepSpeed config",
                description="A training config (ds_config.json) as shardwise.initialize reads it: DeepSpeed's keys "
                            "and spellings; docs/reference/config.md says what each DeepSpeed key does in shardwise.")
    return {"$schema": DRAFT, **root}


def _inline(node: Any, defs: Schema) -> Any:
    """`node` with every `$ref` replaced by a copy of its definition: each key path gets its own schema."""
    if isinstance(node, dict):
        if "$ref" in node:
            target = _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
            return {**target, **{k: _inline(v, defs) for k, v in node.items() if k != "$ref"}}
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def _section(node: Schema | None) -> Schema | None:
    """The object schema with `properties` in `node` (itself, or its branch of an anyOf)."""
    if node is None or "properties" in node:
        return node
    return next((branch for branch in node.get("anyOf", []) if "properties" in branch), None)


def _at(root: Schema, path: str) -> Schema | None:
    node: Schema | None = root
    for part in path.split("."):
        section = _section(node)
        node = section["properties"].get(part) if section else None
    return node


def _add_table_key(root: Schema, path: str, treatment: ds.Treatment) -> None:
    """A DeepSpeed key that is not a shardwise field, under its section (when that section lists keys)."""
    key_path = path.removesuffix(".*")
    parent_path, _, key = key_path.rpartition(".")
    parent = _section(_at(root, parent_path)) if parent_path else root
    if parent is None:
        return  # inside a section that takes any keys
    if key in parent["properties"]:  # a shardwise field: its schema says it all, unless values are limited
        if treatment.accepts is not None:
            parent["properties"][key]["enum"] = list(treatment.accepts)
        return
    schema: Schema = {"description": f"DeepSpeed key, {treatment.kind} here: {treatment.reason}"}
    if treatment.accepts is not None:
        schema["enum"] = list(treatment.accepts)
    elif treatment.kind == ds.REFUSED and treatment.off == ds.DISABLED:
        schema["anyOf"] = _switched_off()
    else:  # any value: a no-op, a refused section switched off by its contents, or a key the parser reads
        schema.update(_PARSER_KEYS.get(key_path, {}))
        if path.endswith(".*"):
            schema["properties"] = {}  # its limited keys go here, when the table has some
    parent["properties"][key] = schema


def _switched_off() -> list[Schema]:
    """The values of a refused section that ask for nothing (`deepspeed_keys.is_switched_off`)."""
    return [{"const": False}, {"type": "null"},
            {"type": "object", "required": ["enabled"], "properties": {"enabled": {"const": False}}},
            {"type": "object", "required": ["device"], "properties": {"device": _any_case(["none"])}}]


def _add_alias(root: Schema, alias: str, target: str) -> None:
    parent_path, _, key = alias.rpartition(".")
    parent, found = _section(_at(root, parent_path)) if parent_path else root, _at(root, target)
    if parent is not None and found is not None:
        parent["properties"][key] = {**copy.deepcopy(found), "description": f"DeepSpeed's other spelling of {target}"}


def _any_case(words: list[str]) -> Schema:
    """Strings equal to one of `words` in any case (JSON schema patterns have no case-insensitive flag)."""
    def letters(word: str) -> str:
        return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else "\\" + c if c in ".+" else c for c in word)

    return {"type": "string", "pattern": "^(" + "|".join(letters(w) for w in words) + ")$"}


def _spellings(root: Schema) -> None:
    """What the validators and the parser normalize before checking (see the module docstring)."""
    props = root["properties"]
    root.pop("required", None)  # the batch triangle: any one of train/micro gives the others
    root["anyOf"] = [{"required": [key]} for key in BATCH_KEYS[:2]]
    for key in BATCH_KEYS:
        props[key] = {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}],
                      "description": ds.TABLE[key].reason}
    props["steps_per_print"] = {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}],
                                "description": ds.TABLE["steps_per_print"].reason}
    props["communication_data_type"]["anyOf"][0] = _any_case(["fp32", "fp16", "bf16"])
    dtype = _any_case(sorted(DTYPE_NAMES))
    for path in ("torch_autocast.dtype", *(f"data_types.{key}_dtype" for key in ("grad_accum", "param", "buffer"))):
        _at(root, path)["anyOf"][0] = dtype
    zero = props["zero_optimization"]
    zero["properties"]["overlap_comm"]["type"] = ["boolean", "null"]
    props["zero_optimization"] = {"anyOf": [zero, {"type": "boolean"}],
                                  "description": ds.TABLE["zero_optimization"].reason}
    props["checkpoint"]["properties"]["tag_validation"] = _any_case(["Ignore", "Warn", "Fail"])
    prof_ops = props["comms_logger"]["properties"]["prof_ops"]["items"]
    prof_ops["enum"] = [*prof_ops["enum"], *OP_ALIASES]
    for key, names in (("optimizer", _optimizer_names()), ("scheduler", _scheduler_names())):
        section = _section(props[key])
        section.pop("required", None)  # a section without `type` builds nothing (as in DeepSpeed), noted
        section["properties"]["type"] = names


def _offload_param_below_stage3(zero: Schema) -> None:
    """Below stage 3 the parser drops offload_param unread (with a note), as DeepSpeed ignores it there."""
    offload_param = zero["properties"]["offload_param"]
    zero["properties"]["offload_param"] = {"description": offload_param.pop("description", "")}
    zero["anyOf"] = [{"properties": {"stage": {"enum": [0, 1, 2]}}}, {"properties": {"offload_param": offload_param}}]


def _optimizer_names() -> Schema:
    torch_names = sorted(n for n, c in vars(torch.optim).items()
                         if isinstance(c, type) and issubclass(c, torch.optim.Optimizer))
    return {"anyOf": [_any_case(list(OPTIMIZER_NAMES)), {"enum": torch_names}],
            "description": "one of DeepSpeed's names (any case) or a torch.optim class name (exact case)"}


def _scheduler_names() -> Schema:
    torch_names = sorted(n for n, c in vars(torch.optim.lr_scheduler).items()
                         if isinstance(c, type) and hasattr(c, "step") and not n.startswith("_"))
    return {"enum": sorted({*SCHEDULER_NAMES, *torch_names}),
            "description": "one of DeepSpeed's schedules or a torch.optim.lr_scheduler class name (exact case)"}


def _allow_auto(node: Schema, prefix: str) -> None:
    """"auto" for every key whose "auto" `resolve_auto` derives, defaults or ignores."""
    section = _section(node)
    for key, item in (section["properties"] if section else {}).items():
        path = prefix + key
        if _section(item) is not None:
            _allow_auto(item, path + ".")
        if accepts_auto(path) and _takes_something(item) and not _takes(item, AUTO):
            annotations = {name: item.pop(name) for name in ("title", "description", "default") if name in item}
            branches = item["anyOf"] if set(item) == {"anyOf"} else [item]
            section["properties"][key] = {**annotations, "anyOf": [*branches, {"const": AUTO}]}


def _takes_something(item: Schema) -> bool:
    return bool({"type", "enum", "const", "anyOf"} & set(item))


def _takes(item: Schema, value: str) -> bool:
    return value in item.get("enum", []) or item.get("const") == value
