"""Hugging Face's Trainer with peft LoRA on the `deepspeed` compatibility package, ZeRO-3 with the optimizer and the
parameters offloaded to the CPU, launched as its users launch it (`deepspeed --num_gpus=1 script.py`), on this
machine's device (CUDA in `make test-gpu`, the CPU in CI): the run finishes, trains on the device with the state
offloaded, the loss falls, and it matches the same script as a plain Trainer run without DeepSpeed (same seed,
same data) to 1e-5, as tests/compat/test_hf_trainer.py asserts on the CPU (its comparison is reused here); the
saved adapter reloads into the base model with peft and carries the training.

The script is tests/compat/scripts/hf_trainer.py (a tiny LLaMA from a local config, HF's "auto" config values,
gradient checkpointing), here on a dataset of one batch seen at every step (`--samples 4`): random tokens are
learnable only by memorising them, so the loss falls within the 4 steps. Two processes in all (the plain run and
the `deepspeed` one); the reload is checked here, on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.compat.conftest import compat_package_installed  # noqa: F401 - autouse: fails early without the package
from tests.compat.run import run_script
from tests.compat.test_hf_trainer import _assert_same
from tests.gpu.device import DEVICE

pytest.importorskip("peft")

FLAGS = ("--lora", "--gc", "--samples", "4")
ADAPTER = "adapter_model.safetensors"


def _run(base: str, out: Path, *flags: str, launcher: str) -> dict[str, Any]:
    result = run_script("hf_trainer.py", "--out", str(out), "--base", base, *FLAGS, *flags, launcher=launcher,
                        env={"DS_ACCELERATOR": DEVICE})
    result["dir"] = out / "final"
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trainer_gpu")
    base = str(root / "llama")  # the first run writes it
    plain = _run(base, root / "plain", "--no-deepspeed", launcher="torchrun")  # `python script.py`, world 1
    zero3 = _run(base, root / "zero3", "--stage", "3", "--offload", launcher="deepspeed")
    return {"base": base, "plain": plain, "zero3": zero3}


def test_zero3_offload_lora_trains_on_the_device_as_the_plain_trainer(runs) -> None:
    zero3, plain = runs["zero3"], runs["plain"]
    assert zero3["devices"] == plain["devices"] == [DEVICE]  # every forward computed on the device
    assert plain["placement"] is None  # no engine in the plain run
    # the engine on the device, its parameter slices and optimizer masters in host memory
    assert zero3["placement"] == {"engine": DEVICE, "offloaded": [True, True], "slices": ["cpu"], "masters": ["cpu"]}
    assert ADAPTER in zero3["saved"] and "model.safetensors" not in zero3["saved"]  # the adapter alone
    _assert_same(zero3, plain, weights=ADAPTER)  # losses, gradient norms and adapter to 1e-5


def test_the_loss_falls(runs) -> None:
    # step 1 trains at learning rate 0 (one warm-up step), so steps 1 and 2 see the same weights; then every
    # step lowers the loss on the one batch (measured 4.1433, 4.1433, 4.1294, 4.1171 on the CPU)
    losses = runs["zero3"]["losses"]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5), losses
    assert losses[1] > losses[2] > losses[3], losses
    assert losses[3] < 0.997 * losses[0], losses


def _batch_loss(model: torch.nn.Module) -> float:
    from tests.compat.scripts.hf_trainer import Tokens

    samples = [Tokens(4)[i] for i in range(4)]
    ids = torch.stack([s["input_ids"] for s in samples])
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_the_saved_adapter_reloads_with_the_training(runs) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    folder, losses = runs["zero3"]["dir"], runs["zero3"]["losses"]
    base = LlamaForCausalLM.from_pretrained(runs["base"]).eval()
    # the base model is where training started: step 1's loss (the adapter's B starts at zero)
    assert _batch_loss(base) == pytest.approx(losses[0], rel=1e-5)
    model = PeftModel.from_pretrained(base, folder).eval()
    saved = load_file(folder / ADAPTER)
    loaded = {n.replace(".default.", "."): p for n, p in model.named_parameters() if "lora_" in n}
    assert sorted(loaded) == sorted(saved) and len(saved) == 2 * 2 * 2  # q and v, A and B, two layers
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
        if "lora_B" in name:
            assert value.abs().max() > 0, f"{name}: untrained (it starts at zero)"
    # four updates are in the adapter: below the loss of step 4, which was measured before its update
    assert _batch_loss(model) < losses[3], (_batch_loss(model), losses)
