from shardwise.runtime.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
