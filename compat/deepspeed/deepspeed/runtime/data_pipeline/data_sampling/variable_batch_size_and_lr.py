"""`deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr`: batches packed by sequence length
with a learning rate scaled to each batch's size. shardwise trains fixed-size micro-batches only (the config's
`data_efficiency.data_sampling.dynamic_batching` is refused too), so these refuse."""

from shardwise.unsupported import unsupported_function

_MODULE = "deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr"
_INSTEAD = ("shardwise has no variable batch size (dynamic batching); train with a fixed "
            "train_micro_batch_size_per_gpu (shardwise's curriculum learning can order samples by length).")

get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed = unsupported_function(
    f"{_MODULE}.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed", _INSTEAD)
get_dataloader_and_lr_scheduler_for_variable_batch_size = unsupported_function(
    f"{_MODULE}.get_dataloader_and_lr_scheduler_for_variable_batch_size", _INSTEAD)

__all__ = ["get_dataloader_and_lr_scheduler_for_variable_batch_size",
           "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed"]
