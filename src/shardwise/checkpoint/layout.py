"""Pure checkpoint layout: file names, the manifest's shape, and turning nested state into
(tensors, JSON) pairs so that nothing is pickled. No torch.distributed here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
MODEL_FILE = "model.safetensors"


def state_file(rank: int) -> str:
    return f"state.rank{rank}.safetensors"


def partial_dir(save_dir: Path, tag: str) -> Path:
    """Where a tag is written before it is complete; never taken for a checkpoint."""
    return save_dir / f".{tag}.partial"


def split_tensors(tree: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Replace every tensor in a nested dict/list by {"__tensor__": key}; return (json_tree, tensors)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node.detach().contiguous().cpu()
            return {"__tensor__": path}
        if isinstance(node, dict):
            return {str(k): walk(v, f"{path}/{k}") for k, v in node.items()} | (
                {"__int_keys__": True} if node and all(isinstance(k, int) for k in node) else {}
            )
        if isinstance(node, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        return node

    return walk(tree, prefix), tensors


def join_tensors(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `split_tensors`."""
    if isinstance(tree, dict):
        if set(tree) == {"__tensor__"}:
            return tensors[tree["__tensor__"]]
        int_keys = tree.get("__int_keys__", False)
        return {(int(k) if int_keys else k): join_tensors(v, tensors) for k, v in tree.items() if k != "__int_keys__"}
    if isinstance(tree, list):
        return [join_tensors(v, tensors) for v in tree]
    return tree


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
