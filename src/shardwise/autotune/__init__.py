"""`shardwise autotune` (DeepSpeed's `--autotuning tune|run`): find the config that fits and trains fastest.

`space.py` reads the search space from the user's config (pure); `search.py` orders and prunes it with the
memory planner and stops hopeless lines early; `experiment.py` runs one candidate through the launcher for a
few steps; `trial.py` is the side of an experiment inside the training processes; `results.py` writes the
tables, the best config and the plot; `cli.py` is the command. Nothing here is imported by a training run
except `trial.py`, and only when its config asks for it.
"""
