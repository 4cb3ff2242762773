"""Optimizers and learning-rate schedulers named in the config."""
