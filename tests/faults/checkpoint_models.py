"""Tiny engines shared by the checkpoint fault tests (a hidden size that can be changed, a buffer)."""

from __future__ import annotations

from typing import Any

import torch

import shardwise

# The error of a rank that ran out of space saving tag 'second' (format with root=re.escape(save_dir)).
NO_SPACE = (r"rank (\d): {root}/\.second\.partial/rank\1\.safetensors: no space left on device \(about \d+ bytes for "
            r"this file, \d+ bytes free on that filesystem now\); free space or save elsewhere\.")


def tiny_model(dim: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.BatchNorm1d(dim), torch.nn.Linear(dim, 4))


def tiny_engine(dim: int = 32, stage: int = 1, **config: Any) -> Any:
    zero = {"stage": stage, **config.pop("zero", {})}
    if stage == 3:
        zero.setdefault("stage3_param_persistence_threshold", 0)
    engine, *_ = shardwise.initialize(model=tiny_model(dim), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero, **config})
    return engine


def train_step(engine: Any, seed: int = 0) -> float:
    dim = engine.module[0].in_features
    g = torch.Generator().manual_seed(seed)
    loss = engine(torch.randn(4, dim, generator=g)).square().mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def error_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    """The message of the exception `fn` raises (its type first); fails if it raises none."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test asserts the type and message
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised nothing")
