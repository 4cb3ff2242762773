"""Recognise a folder DeepSpeed wrote, by its file names alone, to say what it is and what to do instead.

shardwise does not read DeepSpeed checkpoints (pickled `torch.save` files, one layout per ZeRO stage); a
script moved from DeepSpeed often points `load_checkpoint` at one. Without this, the answer would be
"manifest.json: missing", which says nothing of why. Nothing here opens a file: unpickling one to
identify it could run code it holds.

DeepSpeed 0.19.8's names (the save directory holds `latest`, naming a tag folder such as `global_step10`,
and with ZeRO its `zero_to_fp32.py`):
  mp_rank_00_model_states.pt                         the weights (stages 0-2) and the engine's counters
  zero_pp_rank_0_mp_rank_00_model_states.pt          the same at stage 3
  [bf16_]zero_pp_rank_0_mp_rank_00_optim_states.pt   each rank's ZeRO optimizer partition
  layer_03-model_states.pt, layer_03-model_00-model_states.pt   a PipelineModule's layer 3
"""

from __future__ import annotations

import re
from pathlib import Path

from .layout import LATEST, MANIFEST
from .tags import load_tag_problem

_MODEL_STATES = re.compile(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")
_OPTIM_STATES = re.compile(r"(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt")
_LAYER = re.compile(r"layer_\d+-(model_\d+-)?model_states\.pt")
_SCRIPT = "zero_to_fp32.py"
_LISTED = 3


def deepspeed_checkpoint_message(path: Path) -> str | None:
    """What to tell a user whose `path` (a save directory or one of its tag folders) is a DeepSpeed checkpoint
    rather than a shardwise one; None when it does not look like one (or holds a shardwise manifest)."""
    found = _find(path)
    if found is None:
        return None
    tag_dir, names = found
    root = path if tag_dir != path else tag_dir.parent  # the save directory, which DeepSpeed's script is given
    listed = ", ".join(names[:_LISTED]) + (", ..." if len(names) > _LISTED else "")
    return (f"{path}: a DeepSpeed checkpoint ({tag_dir.name}/ holds {listed}), not a shardwise one; shardwise cannot "
            f"read DeepSpeed checkpoints yet. To go on from its weights: {_advice(root, tag_dir, names)} The optimizer "
            "state, lr scheduler and step count are not carried over; save with shardwise from then on.")


def _find(path: Path) -> tuple[Path, list[str]] | None:
    """The tag folder with DeepSpeed's files (`path` itself, the one `latest` names, or a child) and their names."""
    if (path / MANIFEST).is_file():
        return None
    candidates = [path]
    latest = path / LATEST
    if latest.is_file():
        try:
            tag = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            tag = ""
        if tag and not load_tag_problem(tag):
            candidates.append(path / tag)
    try:  # newest first: global_step10 before global_step9
        candidates += sorted((child for child in path.iterdir() if child.is_dir()), key=_natural, reverse=True)
    except OSError:
        pass
    for candidate in candidates:
        names = _deepspeed_files(candidate)
        if names:
            return candidate, names
    return None


def _natural(path: Path) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", path.name)]


def _deepspeed_files(folder: Path) -> list[str]:
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
    except OSError:
        return []
    return [n for n in names if _MODEL_STATES.fullmatch(n) or _OPTIM_STATES.fullmatch(n) or _LAYER.fullmatch(n)]


def _advice(root: Path, tag_dir: Path, names: list[str]) -> str:
    if any(_LAYER.fullmatch(n) for n in names):
        return ("load each layer_XX-model_states.pt (the state dict of the PipelineModule's layer XX; torch.load) into "
                "its layer with load_state_dict before shardwise.initialize.")
    whole = [n for n in names if n.startswith("mp_rank_") and _MODEL_STATES.fullmatch(n)]
    module_entry = (f"load the 'module' entry of {tag_dir / whole[0]} (the whole model, in the training dtype; "
                    "torch.load(..., weights_only=False) unpickles it, so only for a file you trust) with "
                    "model.load_state_dict before shardwise.initialize.") if whole else ""
    if not any(_OPTIM_STATES.fullmatch(n) for n in names):
        return module_entry
    script = root / _SCRIPT if (root / _SCRIPT).is_file() else f"DeepSpeed's deepspeed/utils/{_SCRIPT}"
    tag = "" if _latest(root) == tag_dir.name else f" --tag {tag_dir.name}"
    fp32 = (f"where DeepSpeed itself is installed (the script unpickles DeepSpeed's objects, which shardwise's "
            f"`deepspeed` package does not have), consolidate the fp32 weights with `python {script} {root} "
            f"<output_dir>{tag} --safe_serialization`, then load them (safetensors.torch.load_file, then "
            "model.load_state_dict) before shardwise.initialize.")
    return fp32 + (f" Or, without DeepSpeed, {module_entry}" if module_entry else "")


def _latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
