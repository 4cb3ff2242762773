"""Find the DeepSpeed checkpoint in a folder, by its file names alone (nothing is opened here).

A script moved from DeepSpeed points `load_checkpoint` at DeepSpeed's save directory (or a Hugging Face
`checkpoint-N` folder, which is one), whose `latest` names a tag folder such as `global_step10`, or straight at
the tag folder (or at a universal checkpoint, which `latest_universal` names). DeepSpeed 0.19.8's names in a tag
folder:
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
_LISTED = 3
UNIVERSAL_LATEST = "latest_universal"  # what ds_to_universal.py writes beside its <tag>_universal folder


def deepspeed_tag_dir(path: Path, tag: str | None = None) -> Path | None:
    """The DeepSpeed tag folder `path` (a save directory or a tag folder) and `tag` lead to; None when they
    lead to no folder of DeepSpeed's files (or to a shardwise checkpoint)."""
    candidates = [path / tag] if tag is not None else [path, path / (_latest(path) or MANIFEST),
                                                        path / (_latest(path, UNIVERSAL_LATEST) or MANIFEST)]
    for candidate in candidates:
        if not (candidate / MANIFEST).is_file() and deepspeed_files(candidate):
            return candidate
    return None


def deepspeed_checkpoint_message(path: Path) -> str | None:
    """What to tell a user whose `path` holds DeepSpeed tag folders that no `latest` names; None otherwise."""
    if (path / MANIFEST).is_file() or _latest(path):
        return None
    try:  # newest first: global_step10 before global_step9
        children = sorted((child for child in path.iterdir() if child.is_dir()), key=_natural, reverse=True)
    except OSError:
        return None
    for child in children:
        names = deepspeed_files(child)
        if names:
            listed = ", ".join(names[:_LISTED]) + (", ..." if len(names) > _LISTED else "")
            return (f"{path}: holds DeepSpeed checkpoints ({child.name}/ holds {listed}) but no 'latest' file naming "
                    f"one; pass tag={child.name!r} (the newest) or point at a tag folder.")
    return None


def _natural(path: Path) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", path.name)]


def deepspeed_files(folder: Path) -> list[str]:
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
    except OSError:
        return []
    return [n for n in names if _MODEL_STATES.fullmatch(n) or _OPTIM_STATES.fullmatch(n) or _LAYER.fullmatch(n)]


def _latest(root: Path, name: str = LATEST) -> str | None:
    try:
        tag = (root / name).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return tag if tag and not load_tag_problem(tag) else None
