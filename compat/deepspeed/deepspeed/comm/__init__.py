"""`deepspeed.comm`: torch.distributed under DeepSpeed's signatures (shardwise.distributed.comm)."""

from shardwise.distributed.comm import *  # noqa: F401,F403
from shardwise.distributed.comm import __all__  # noqa: F401
