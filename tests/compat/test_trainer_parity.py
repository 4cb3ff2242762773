"""The same Hugging Face Trainer script under the real DeepSpeed 0.19.8 and under shardwise's compatibility
package: fp32 losses and gradient norms within 1e-5 (the parity target is 1e-4), saved weights alike.

Needs an interpreter with the real DeepSpeed: `make test-deepspeed` (as .ci/run does) sets
SHARDWISE_DEEPSPEED_PYTHON to .dsvenv's. Both get torchrun's environment, forked from a pre-imported interpreter
(run.py). (shardwise's Trainer runs at two processes under its `deepspeed` command are compared with the
plain-Trainer oracle in test_hf_trainer.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.compat.run import deepspeed_python, run_script

pytestmark = [
    pytest.mark.deepspeed_parity,
    pytest.mark.skipif(deepspeed_python() is None, reason="needs the real DeepSpeed: SHARDWISE_DEEPSPEED_PYTHON "
                       "(set by `make test-deepspeed`, which .ci/run runs)"),
]
RTOL = 1e-5
CASES = {  # name: (flags, world size)
    "zero0-ds-optimizer": (["--stage", "0", "--ds_optimizer"], 1),
    "zero3-offload-lora-auto": (["--stage", "3", "--offload", "--lora", "--ds_optimizer"], 1),
    "zero2-two-ranks": (["--stage", "2", "--ds_optimizer"], 2),
    # Two processes at ZeRO-3 fail in the real DeepSpeed on CPU: the `zero.Init` that from_pretrained enters
    # counts one process there (accelerate's CPU path) and asserts on the batch sizes the Trainer filled in.
    "zero3-lora-gc": (["--stage", "3", "--lora", "--gc"], 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_matches_deepspeed(case, tmp_path):
    flags, world = CASES[case]
    base = str(tmp_path / "base")
    theirs = run_script("hf_trainer.py", "--out", str(tmp_path / "ds"), "--base", base, *flags, world=world,
                        python=deepspeed_python())
    ours = run_script("hf_trainer.py", "--out", str(tmp_path / "sw"), "--base", base, *flags, world=world)
    assert ours["steps"] == theirs["steps"] and ours["saved"] == theirs["saved"]
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=RTOL)
    # DeepSpeed reports no gradient norm with some optimizers (stage 0 with its own: None); shardwise always does
    known = [(a, b) for a, b in zip(ours["grad_norms"], theirs["grad_norms"]) if b is not None]
    assert all(a == pytest.approx(b, rel=RTOL) for a, b in known), known
    weights = "adapter_model.safetensors" if "--lora" in flags else "model.safetensors"
    a, b = load_file(tmp_path / "sw" / "final" / weights), load_file(tmp_path / "ds" / "final" / weights)
    assert set(a) == set(b)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=RTOL, atol=1e-6, msg=lambda m: f"{key}: {m}")
