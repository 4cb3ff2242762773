from shardwise.checkpoint.fp32 import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
