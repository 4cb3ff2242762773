"""What `engine.load_checkpoint` says at world size 2: a peft-style resume (frozen parameters left out of the
checkpoint by design) in one line from rank 0, a missing trainable parameter still warned by name, and a
DeepSpeed checkpoint loaded with one line from rank 0 on what it cannot carry over."""

from __future__ import annotations

import logging

from tests.harness import run_distributed
from tests.logs import LogMessages
from tests.parity import ds_config, engine_run, make_model, param_groups
from tests.deepspeed_checkpoints import FIXTURES

BY_DESIGN = ("load_checkpoint: {} left out of the checkpoint by design (saved with exclude_frozen_parameters=True) "
             "and keep their loaded values.")
MISSING = "load_checkpoint: parameters not in the checkpoint keep their values: "


def _resume(root, deepspeed_root):
    import shardwise

    config = ds_config(2, 1, zero_optimization={"stage": 1})
    _, _, engine = engine_run(config, 1)
    engine.save_checkpoint(root, tag="lean", exclude_frozen_parameters=True)  # what HF's Trainer asks for with peft
    logger = logging.getLogger("shardwise.checkpoint")
    logger.setLevel(logging.INFO)
    said = {}
    for case in ("frozen", "trainable"):
        model = make_model()
        if case == "trainable":
            model.frozen.weight.requires_grad_(True)  # trains now, so its absence is a loss worth naming
        fresh, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
        messages = LogMessages()
        logger.addHandler(messages)
        fresh.load_checkpoint(root, tag="lean", load_module_strict=False)
        logger.removeHandler(messages)
        said[case] = messages.messages
    messages = LogMessages()
    logger.addHandler(messages)
    engine.load_checkpoint(deepspeed_root)
    logger.removeHandler(messages)
    said["deepspeed"] = messages.messages
    return said


def test_load_messages(tmp_path):
    ds_root = FIXTURES / "zero2"
    rank0, rank1 = run_distributed(_resume, 2, str(tmp_path / "sw"), str(ds_root))
    assert rank0["frozen"] == [BY_DESIGN.format("2 frozen parameters were")]
    assert rank0["trainable"] == [BY_DESIGN.format("1 frozen parameter was"), MISSING + "['frozen.weight']"]
    assert rank1["frozen"] == rank1["trainable"] == []  # every rank knows the whole model's names: rank 0 says it
    assert rank0["deepspeed"] == [f"load_checkpoint: {ds_root / 'global_step3'} is a DeepSpeed checkpoint, which "
                                  "holds no RNG state and no data loader position; both start afresh."]
    assert rank1["deepspeed"] == []
