"""`deepspeed.zero` (DeepSpeed's alias of `deepspeed.runtime.zero`)."""

from ..runtime.zero import *  # noqa: F401,F403
from ..runtime.zero import __all__  # noqa: F401
