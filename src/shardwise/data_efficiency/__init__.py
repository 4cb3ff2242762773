"""Data efficiency: curriculum learning (by sequence length, or by analysed data difficulty) and random
layerwise token dropping (random-LTD), each driven by its config section through the ordinary engine."""

from . import metrics
from .analyzer import DataAnalyzer
from .index import MetricIndex, MetricIndexError
from .sampler import CurriculumSampler
from .schedule import DifficultySchedule, kept_tokens
from .seqlen import CurriculumError

__all__ = ["CurriculumError", "CurriculumSampler", "DataAnalyzer", "DifficultySchedule", "MetricIndex",
           "MetricIndexError", "kept_tokens", "metrics"]
