"""`deepspeed.runtime.utils`: the helpers scripts call from it."""

import random

import numpy as np
import torch
from shardwise.profiling.memory import see_memory_usage
from shardwise.runtime.data import move_to_device


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy's global generator and torch's (every device's), as DeepSpeed's does. numpy
    takes 32-bit seeds and torch 64-bit signed ones, so a larger seed is reduced modulo those, as there."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


__all__ = ["move_to_device", "see_memory_usage", "set_random_seed"]
