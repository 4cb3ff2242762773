"""A DeepSpeed checkpoint saved without ZeRO (stage 0): its optimizer state, matched to parameter names through the
loading engine's optimizer groups.

Stage 0 keeps the optimizer's own state dict, which records parameters by position, not name, in one of two forms
(DeepSpeed 0.19.8):
- fp32: the optimizer's `state_dict()`: `state[i]` for the i-th parameter over the groups in order (frozen ones
  included in the count, without state), each moment shaped as its parameter. DeepSpeed's FusedAdam advances
  only the step of each group's last parameter with a gradient and applies it to the whole group, so a group's
  step is the largest of its parameters'.
- bf16 (and fp16): `fp32_groups_flat[g]`, each group's trainable parameters flattened in order (the fp32
  masters), and the inner optimizer's state dict over those flats (`optimizer_state_dict.state[g]`). fp16's
  (DeepSpeed's FP16_Optimizer, with its loss-scaler fields beside them) is refused: its updates differ from
  DeepSpeed's ZeRO optimizers' (from the same state, the next losses are ~1% apart from DeepSpeed's own
  continuation), so loading it could not continue DeepSpeed's run.
The groups are the loading script's (`engine.param_group_names`), which must be the saving script's; every size is
checked against them, so groups built differently are refused, not loaded into the wrong parameters.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .deepspeed_reader import _Flat, hyper_parameters, step_scalars, tensor_keys
from .errors import CheckpointError


def bind_stage0(reader: Any, groups: list[list[str]], trains: dict[str, bool]) -> None:
    """Tell `reader` (a stage-0 DeepSpeedReader) where each parameter's master and moments are: `groups` are the
    loading engine's optimizer groups by name, `trains` whether each of the model's parameters trains (stage 0
    does not record which are frozen)."""
    saved = reader.common.get("optimizer")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{reader.path}: a stage-0 DeepSpeed checkpoint without optimizer state; pass "
                              "load_optimizer_states=False.")
    for name in reader.shapes:
        reader.trainable[name] = trains.get(name, reader.trainable[name])
        reader.meta["params"][name]["trainable"] = reader.trainable[name]
    trainable = [[n for n in group if reader.has(n) and reader.trainable[n]] for group in groups]
    if "fp32_groups_flat" in saved and "cur_scale" in saved:
        raise CheckpointError(
            f"{reader.path}: a DeepSpeed checkpoint saved at ZeRO stage 0 with fp16, whose optimizer (DeepSpeed's "
            "FP16_Optimizer) updates differently from DeepSpeed's ZeRO optimizers and shardwise's: resumed from its "
            "state, the next losses differ from DeepSpeed's own continuation by about 1% (measured in "
            "tests/distributed/test_deepspeed_checkpoint_migration.py), so its optimizer state is not loaded. Pass "
            "load_optimizer_states=False to load the weights (exact) and train on with a fresh optimizer, or resume "
            "with DeepSpeed.")
    if "fp32_groups_flat" in saved:
        _bind_flat(reader, saved, trainable)
    elif "state" in saved and "param_groups" in saved:
        _bind_by_position(reader, saved, groups)
    else:
        raise CheckpointError(f"{reader.path}: a stage-0 DeepSpeed optimizer state of a form shardwise does not read "
                              f"(keys {sorted(saved)[:8]}); pass load_optimizer_states=False to load the weights.")
    reader.bound = True
    meta = reader.meta["optimizer"]
    meta["groups"] = trainable
    meta["param_groups"] = hyper_parameters(reader.saved_stage0_groups)


def _bind_flat(reader: Any, saved: dict[str, Any], groups: list[list[str]]) -> None:
    flats, inner = saved["fp32_groups_flat"], saved["optimizer_state_dict"]
    live = [g for g in groups if g]
    if len(flats) != len(live):
        raise _mismatch(reader, f"{len(flats)} optimizer groups saved, {len(live)} with trainable parameters now")
    reader._states = tensor_keys(inner["state"].get(0, {}))
    reader._masters = [_Flat([f]) for f in flats]
    reader._state_flats = {k: [_Flat([inner["state"][g][k]]) for g in range(len(flats))] for k in reader._states}
    for g, names in enumerate(live):
        offset = 0
        for name in names:
            reader._where[name] = (g, offset)
            offset += math.prod(reader.shapes[name])
        if offset != flats[g].numel():
            raise _mismatch(reader, f"group {g} holds {flats[g].numel()} elements, its parameters now {offset}")
    reader.saved_stage0_groups = list(inner["param_groups"])
    steps = [int(inner["state"][g]["step"]) for g in range(len(flats)) if "step" in inner["state"].get(g, {})]
    reader.meta["optimizer"]["scalars"] = step_scalars(reader.path, steps)


def _bind_by_position(reader: Any, saved: dict[str, Any], groups: list[list[str]]) -> None:
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    if sizes != [len(g) for g in groups]:
        raise _mismatch(reader, f"parameters per group saved {sizes}, now {[len(g) for g in groups]}")
    names = [n for group in groups for n in group]
    state = saved["state"]
    reader._states = tensor_keys(next((s for s in state.values() if s), {}))
    reader._masters, reader._state_flats = [], {k: [] for k in reader._states}
    steps = []
    for g, group in enumerate(saved["param_groups"]):
        group_steps = [int(state[i]["step"]) for i in group["params"] if "step" in state.get(i, {})]
        steps += [max(group_steps)] if group_steps else []
        for i in group["params"]:
            name = names[i]
            if not reader.trainable.get(name):
                continue
            if i not in state or tuple(state[i][reader._states[0]].shape) != reader.shapes[name]:
                raise _mismatch(reader, f"parameter {i} ({name!r}) has no state of its shape {reader.shapes[name]}")
            reader._where[name] = (len(reader._masters), 0)
            reader._masters.append(_Flat([reader.common["module"][name].to(torch.float32)]))
            for key in reader._states:
                reader._state_flats[key].append(_Flat([state[i][key]]))
    reader.saved_stage0_groups = list(saved["param_groups"])
    reader.meta["optimizer"]["scalars"] = step_scalars(reader.path, steps)


def _mismatch(reader: Any, what: str) -> CheckpointError:
    return CheckpointError(f"{reader.path}: a stage-0 DeepSpeed checkpoint records its optimizer state by position; "
                           f"this run's optimizer groups do not match the saving run's ({what}). Build the groups as "
                           "the saving script did, or pass load_optimizer_states=False to load the weights only.")
