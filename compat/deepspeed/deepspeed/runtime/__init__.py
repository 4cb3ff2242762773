from . import zero

__all__ = ["zero"]
