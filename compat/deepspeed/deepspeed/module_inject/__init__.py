"""`deepspeed.module_inject`: the AutoTP switch scripts call before building a model."""

from . import layers

__all__ = ["layers"]
