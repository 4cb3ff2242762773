"""Where a run's figures go: console now; CSV, TensorBoard and wandb behind one protocol later."""
