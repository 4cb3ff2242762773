from . import helper

__all__ = ["helper"]
