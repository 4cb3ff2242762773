"""`deepspeed.runtime.data_pipeline.data_sampling`."""

from . import data_analyzer

__all__ = ["data_analyzer"]
