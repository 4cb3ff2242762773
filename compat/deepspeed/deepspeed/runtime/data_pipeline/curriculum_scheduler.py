"""`deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`: shardwise's difficulty schedule
behind DeepSpeed's API."""

from shardwise.data_efficiency.seqlen import LegacyCurriculumScheduler as CurriculumScheduler

__all__ = ["CurriculumScheduler"]
