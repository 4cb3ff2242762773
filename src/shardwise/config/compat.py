"""Apply the DeepSpeed key table (`deepspeed_keys.py`) to a raw config, before validation.

- `apply_spellings`: DeepSpeed's other spellings become shardwise's (aliases, `cpu_offload` flags,
  `zero_optimization: true`), and `offload_param` and the ZeRO++ keys below stage 3 are dropped with a
  note, as DeepSpeed ignores them there.
- `strip_deepspeed_only`: keys that are not shardwise fields are taken out: no-ops with a one-time note
  (or warning), refused features as problems (quietly when switched off), limited keys refused when
  their value is not the one shardwise's behaviour equals. Keys the table does not know are left for
  validation, which reports them as unknown with a "did you mean".

Notes are given once per job, on rank 0, and only for keys DeepSpeed itself would act on at this config
(`DEEPSPEED_READS_AT`): a stage-3 knob in a stage-2 config does nothing in DeepSpeed either, and a note
saying it does nothing here is noise.
"""

from __future__ import annotations

import json
import logging
import types
import typing
from typing import Any

from pydantic import BaseModel

from . import deepspeed_keys as ds
from .notes import note_once_per_job

logger = logging.getLogger("shardwise.config")

_MISSING = object()


def apply_spellings(raw: dict[str, Any], problems: list[str]) -> None:
    _dotted_top_level_keys(raw)
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's oldest form: true is stage 1
        raw["zero_optimization"] = {"stage": int(zero)}
    for alias, target in ds.ALIASES.items():
        _move(raw, alias, target, problems)
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        _old_offload_flags(zero, problems)
        _stage3_keys_below_stage3(zero)


def _dotted_top_level_keys(raw: dict[str, Any]) -> None:
    """Top-level "section.key"s (TRL's and accelerate's prepare_deepspeed write "zero_optimization.reduce_bucket_size"
    so): DeepSpeed 0.19.8 reads settings inside their sections only, so such a key changes nothing there and is
    dropped here with a warning; honouring it would train unlike DeepSpeed. A dotted key whose first part names no
    section is left for validation (unknown key, "did you mean")."""
    sections = _sections()
    dotted = {key: raw.pop(key) for key in list(raw)
              if isinstance(key, str) and "." in key and key.split(".", 1)[0] in sections}
    if dotted:
        given = ", ".join(f"{key}={shown(value)}" for key, value in dotted.items())
        note_once_per_job(logger, logging.WARNING,
                          f"config: {given}: ignored, as DeepSpeed ignores them: a setting is read only inside its "
                          "section, never from a top-level key with a dot. Write it inside the section (e.g. "
                          '"zero_optimization": {"reduce_bucket_size": ...}) to set it.')


def _sections() -> set[str]:
    """Top-level names that hold a section: shardwise's, and DeepSpeed's that shardwise does not have."""
    from .sections import Config

    ours = {name for name, field in Config.model_fields.items() if section_type(field.annotation) is not None}
    return ours | {path.split(".", 1)[0] for path in ds.TABLE if "." in path}


def drop_untyped(raw: dict[str, Any]) -> None:
    """An `optimizer` / `scheduler` section without `type` builds nothing in DeepSpeed, its params unused."""
    for section in ("optimizer", "scheduler"):
        value = raw.get(section)
        if isinstance(value, dict) and "type" not in value:
            raw.pop(section)
            if value.get("params"):
                note_once_per_job(logger, logging.WARNING,
                                  f"{section}.params: ignored: the section has no `type`, so no {section} is built "
                                  f"from it (as in DeepSpeed). Add {section}.type, or remove the section.")


def _move(raw: dict[str, Any], alias: str, target: str, problems: list[str]) -> None:
    *parents, leaf = alias.split(".")
    node = _node(raw, parents)
    if node is None or leaf not in node:
        return
    value = node.pop(leaf)
    *target_parents, target_leaf = target.split(".")
    into = _node(raw, target_parents, create=True)
    if into is None:
        return
    existing = into.get(target_leaf, _MISSING)
    if existing is not _MISSING and existing != value:
        problems.append(f"{alias} and {target}: two spellings of one setting with different values ({value!r} and "
                        f"{existing!r}); keep one.")
        return
    into[target_leaf] = value


def _node(raw: dict[str, Any], parts: list[str], create: bool = False) -> dict[str, Any] | None:
    node: Any = raw
    for part in parts:
        if not isinstance(node, dict):
            return None
        if part not in node and create:
            node[part] = {}
        node = node.get(part)
    return node if isinstance(node, dict) else None


_OLD_FLAGS = (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"))
_NEW_SPELLING = {"cpu_offload": 'the offload_optimizer section ({"device": "cpu"})',
                 "cpu_offload_param": 'the offload_param section ({"device": "cpu"})',
                 "cpu_offload_use_pin_memory": "pin_memory in the offload sections"}


def _old_offload_flags(zero: dict[str, Any], problems: list[str]) -> None:
    """DeepSpeed's old booleans. Anything but true, false, null or "auto" is refused: a string such as "yes"
    would otherwise mean off without a word."""
    for flag, replacement in _NEW_SPELLING.items():
        value = zero.get(flag)
        if not (value is None or isinstance(value, bool) or value == "auto"):
            zero.pop(flag)
            problems.append(f"zero_optimization.{flag}: must be true or false; got {value!r}. Write true or false, "
                            f"or use {replacement} instead.")
    for flag, section in _OLD_FLAGS:
        if flag in zero and zero.pop(flag) is True:
            zero.setdefault(section, {"device": "cpu"})
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    if isinstance(pin, bool):
        for section in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(section), dict):
                zero[section].setdefault("pin_memory", pin)


_ZEROPP = "ZeRO++ changes stage 3's weight gathers and gradient reduction. Set stage 3 to use it."
STAGE3_ONLY = {
    "offload_param": "parameters stay on the device. Use offload_optimizer at stages 1-2, or stage 3.",
    "zero_hpz_partition_size": _ZEROPP, "zero_quantized_weights": _ZEROPP, "zero_quantized_gradients": _ZEROPP,
}
"""Keys DeepSpeed reads at stage 3 only, and what a note says when a config below it asks for them."""
ZEROPP_OFF = {"zero_hpz_partition_size": 1, "zero_quantized_weights": False, "zero_quantized_gradients": False}


def _asks(key: str, value: Any) -> bool:
    if key == "offload_param":
        return not ds.is_switched_off(value)
    return value not in (ZEROPP_OFF[key], "auto")  # "auto" is refused by validation, at every stage


def _stage3_keys_below_stage3(zero: dict[str, Any]) -> None:
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or stage >= 3:
        return
    for key, why in STAGE3_ONLY.items():
        if key in zero and _asks(key, zero[key]):
            zero.pop(key)
            note_once_per_job(logger, logging.WARNING, f"zero_optimization.{key}: ignored below ZeRO stage 3, as "
                              f"DeepSpeed does (got stage {stage}); {why}")


_STAGE3, _STAGES_1_2, _ZERO = (3,), (1, 2), (1, 2, 3)
DEEPSPEED_READS_AT: dict[str, tuple[int, ...]] = {
    # Built by DeepSpeed 0.19.8's stage-3 optimizer or zero.Init only.
    "zero_optimization.stage3_module_granularity_threshold": _STAGE3,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _STAGE3,
    "zero_optimization.stage3_allgather_sequential": _STAGE3,
    "zero_optimization.memory_efficient_linear": _STAGE3,
    "zero_optimization.override_module_apply": _STAGE3,
    "zero_optimization.pipeline_loading_checkpoint": _STAGE3,
    "zero_optimization.log_trace_cache_warnings": _STAGE3,
    "zero_optimization.enable_sanity_checks": _STAGE3,
    "zero_optimization.save_muon_momentum_buffer_in_memory": _STAGE3,
    "zero_optimization.leaf_module": _STAGE3,
    "zero_optimization.offload_param": _STAGE3,
    "zero_optimization.offload_optimizer.super_offload": _STAGE3,
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": _STAGE3,
    # Arguments of the stage 1-2 optimizer only.
    "zero_optimization.round_robin_gradients": _STAGES_1_2,
    "zero_optimization.use_multi_rank_bucket_allreduce": _STAGES_1_2,
    "zero_optimization.legacy_stage1": _STAGES_1_2,
    "zero_optimization.ignore_unused_parameters": _STAGES_1_2,
    "zero_optimization.parameter_alignment": _STAGES_1_2,
    "zero_optimization.compute_grad_norm": _STAGES_1_2,
    "zero_optimization.allgather_bucket_size": (0, 1, 2),  # stage 0 too: DeepSpeed's bf16 optimizer takes it
    # Any ZeRO optimizer (none at stage 0).
    "zero_optimization.reduce_scatter": _ZERO,
    "zero_optimization.contiguous_gradients": _ZERO,
    "zero_optimization.elastic_checkpoint": _ZERO,
    "zero_optimization.offload_optimizer": _ZERO,
    "zero_allow_untested_optimizer": _ZERO,
    "zero_force_ds_cpu_optimizer": _ZERO,
    # Read by no code path of DeepSpeed 0.19.8.
    "zero_optimization.allgather_partitions": (),
    "disable_allgather": (),
}
"""The ZeRO stages at which DeepSpeed acts on a no-op key (the key or a section above it); keys not listed act at
every stage."""
NVME_ONLY = {"buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline_read", "pipeline_write"}
"""Offload sub-keys that size or schedule NVMe swapping: DeepSpeed reads them only when the device is nvme."""


def deepspeed_reads(path: str, raw: dict[str, Any]) -> bool:
    """Whether DeepSpeed 0.19.8 acts on the key `path` in the config `raw` (after `apply_spellings`). Unsure
    (a stage that is not a number yet, which validation refuses later) counts as yes."""
    parts = ds.canonical(path).split(".")
    zero = raw.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    stage = zero.get("stage", 0)
    for i in range(len(parts), 0, -1):
        stages = DEEPSPEED_READS_AT.get(".".join(parts[:i]))
        if stages is not None:
            if isinstance(stage, int) and not isinstance(stage, bool) and stage not in stages:
                return False
            break
    if parts[:1] == ["zero_optimization"] and len(parts) == 3 and parts[1] in ("offload_optimizer", "offload_param"):
        section = zero.get(parts[1])
        device = str(section.get("device", "none")).lower() if isinstance(section, dict) else "none"
        return device != "none" and (parts[2] not in NVME_ONLY or device == "nvme")
    return True


def strip_deepspeed_only(raw: dict[str, Any], model: type[BaseModel], problems: list[str]) -> None:
    _walk(raw, model, "", problems, quiet=False, raw=raw)


def _walk(node: dict[str, Any], model: type[BaseModel] | None, prefix: str, problems: list[str], quiet: bool,
          raw: dict[str, Any]) -> None:
    for key in list(node):
        path, value = prefix + key, node[key]
        treatment = ds.lookup(path)
        if treatment is not None and treatment.accepts is not None and not ds.accepted_value(treatment, value):
            node.pop(key)
            problems.append(_not_implemented(path, value, treatment))
            continue
        nested = _field_model(model, key) if model is not None and key in model.model_fields else _MISSING
        if nested is not _MISSING:  # a shardwise field: validation takes it from here
            if treatment is not None and treatment.kind == ds.NO_OP and not quiet:
                _note(path, treatment, raw)
            if isinstance(nested, type) and isinstance(value, dict):
                _walk(value, nested, path + ".", problems, quiet, raw)
            continue
        if treatment is None or treatment.kind == ds.IMPLEMENTED:
            continue  # unknown (or a typo inside a shardwise section): validation names it
        node.pop(key)
        if treatment.kind == ds.REFUSED:
            if treatment.accepts is None and not ds.is_switched_off(value, treatment.off):
                problems.append(_not_implemented(path, value, treatment))
            continue
        if isinstance(value, dict):
            _walk(value, None, path + ".", problems, quiet=True, raw=raw)  # a refused key inside a no-op section
        if not quiet:
            _note(path, treatment, raw)


def _field_model(model: type[BaseModel], key: str) -> Any:
    """The section model of field `key` (None for a plain field)."""
    return section_type(model.model_fields[key].annotation)


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside `X`, `X | None` or `Optional[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = section_type(arg)
            if found is not None:
                return found
    return None


def _note(path: str, treatment: ds.Treatment, raw: dict[str, Any]) -> None:
    if not deepspeed_reads(path, raw):
        return
    if treatment.kind == ds.WARNED:
        note_once_per_job(logger, logging.WARNING, f"{path}: a DeepSpeed setting that shardwise does not act on yet; "
                          f"ignored ({treatment.reason}).")
    else:
        note_once_per_job(logger, logging.INFO,
                          f"{path}: a DeepSpeed setting with no effect in shardwise ({treatment.reason}).")


def shown(value: Any) -> str:
    """A value as the user wrote it in JSON (true, null, "auto"), shortened."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _not_implemented(path: str, value: Any, treatment: ds.Treatment) -> str:
    if treatment.accepts is not None:
        allowed = " or ".join(shown(a) for a in treatment.accepts)
        return (f"{path}: a DeepSpeed setting that shardwise does not implement yet for values other than {allowed} "
                f"({treatment.reason}); got {shown(value)}. Remove it or set it to {shown(treatment.accepts[0])}.")
    return (f"{path}: a DeepSpeed setting that shardwise does not implement yet ({treatment.reason}); it changes what "
            f"is trained or where memory goes, so it is refused rather than ignored; got {shown(value)}. Remove it (or set "
            "it to disabled) to train without it.")
