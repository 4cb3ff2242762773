"""The engine and what it sequences each step: data loading, the step arithmetic, the DeepSpeed-named surface.

Nothing is re-exported here: `shardwise.initialize` builds the engine (runtime/engine.py).
"""
