from . import transformer

__all__ = ["transformer"]
