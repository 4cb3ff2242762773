"""Full fine-tuning (examples/finetune_llm, --mode full) under ZeRO-3, with and without CPU / NVMe offload,
against the single-process loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.test_finetune_lora import (  # noqa: F401 - model_dirs is a fixture
    CLIP, OPTIMIZERS, WORLD, _args, _examples, _oracle, _rank_batches, model_dirs)
from tests.harness import run_distributed
from tests.parity import full_state_dict

pytest.importorskip("transformers")
pytest.importorskip("peft")

from examples.finetune_llm import train  # noqa: E402

OFFLOAD = {
    "none": {},
    "cpu-optimizer": {"offload_optimizer": {"device": "cpu"}},
    "cpu-optimizer-and-params": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "nvme-optimizer-and-params": {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}},
}
STEPS = 5


def zero_section(offload: str, nvme_path: Path) -> dict:
    """ZeRO-3 with every parameter partitioned (no persistent ones) and the named offload."""
    sections = {k: {**v, "nvme_path": str(nvme_path)} if v["device"] == "nvme" else v
                for k, v in OFFLOAD[offload].items()}
    return {"stage": 3, "stage3_param_persistence_threshold": 0, **sections}


def _full_run(model_dir: Path, tmp: Path, offload: str, checkpointing: dict | None):
    import shardwise
    from shardwise.config import parse_config

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": dict(zip(("type", "params"), OPTIMIZERS["sgd"])),
              "gradient_clipping": CLIP, "zero_optimization": zero_section(offload, tmp / "nvme")}
    if checkpointing is not None:
        config["activation_checkpointing"] = checkpointing
    section = parse_config(config, dp_size=WORLD).activation_checkpointing if checkpointing is not None else None
    model = train.build_model(_args(model_dir, "llama", tmp, mode="full"), zero_stage=3, checkpointing=section)
    recomputed = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: recomputed.append(1))
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
    examples = _examples(model_dir, 64)
    losses = [train.train_step(engine, _rank_batches(examples, s))[0] for s in range(STEPS)]
    return losses, full_state_dict(engine), len(recomputed)


# The config's activation_checkpointing section (cpu_checkpointing: the recompute inputs kept in host
# memory) through the script's Hugging Face hook, at ZeRO-3 with every parameter partitioned.
CHECKPOINTED = {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True, "partition_activations": True}


@pytest.mark.parametrize("offload,checkpointing", [(name, None) for name in OFFLOAD] + [("none", CHECKPOINTED)],
                         ids=[*OFFLOAD, "none-activation-checkpointing"])
def test_full_finetuning_matches_single_process(offload, checkpointing, model_dirs, tmp_path):  # noqa: F811
    ref_losses, ref_params = _oracle(model_dirs["llama"], "llama", STEPS, "sgd", full=True)
    losses, params, forwards = run_distributed(_full_run, WORLD, model_dirs["llama"], tmp_path, offload, checkpointing,
                                               timeout=240)[0]
    assert forwards == STEPS * (2 if checkpointing else 1)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * b, (losses, ref_losses)
    assert losses[-1] < losses[0]
    assert set(params) >= set(ref_params)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
