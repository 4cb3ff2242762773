"""`deepspeed.runtime.data_pipeline.data_sampling.data_analyzer.DataAnalyzer`: shardwise's analyzer (its own
index format, read by shardwise's curriculum sampler)."""

from shardwise.data_efficiency.analyzer import DataAnalyzer

__all__ = ["DataAnalyzer"]
