"""`deepspeed.runtime.data_pipeline.data_routing.scheduler.RandomLTDScheduler`: the class of
`engine.random_ltd_scheduler` (get_current_seq, state_dict, get_total_layer_tokens, ...). The engine builds it from
the config; its constructor is shardwise's, not DeepSpeed's config-dict one."""

from shardwise.data_efficiency.random_ltd import RandomLTDScheduler

__all__ = ["RandomLTDScheduler"]
