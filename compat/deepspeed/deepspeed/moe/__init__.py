from . import layer, utils

__all__ = ["layer", "utils"]
