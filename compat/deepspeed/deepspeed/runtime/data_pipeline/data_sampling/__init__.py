"""`deepspeed.runtime.data_pipeline.data_sampling`."""

from . import data_analyzer, indexed_dataset, variable_batch_size_and_lr

__all__ = ["data_analyzer", "indexed_dataset", "variable_batch_size_and_lr"]
