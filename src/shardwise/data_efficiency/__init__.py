"""Data efficiency: curriculum learning (by sequence length, or by analysed data difficulty) and random
layerwise token dropping (random-LTD), each driven by its config section through the ordinary engine."""

from .schedule import DifficultySchedule, kept_tokens

__all__ = ["DifficultySchedule", "kept_tokens"]
