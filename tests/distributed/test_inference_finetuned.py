"""The fine-tuning example's LoRA run, served from its shardwise checkpoint at tensor-parallel size 2.

`examples/finetune_llm/train.py` trains LoRA under ZeRO-3 with 2 processes (launched by `shardwise`), saving a
checkpoint, the adapter and the merged weights. The inference engine then builds the model on the meta device
(base config + the adapter's config for the LoRA layers), reads every weight, base and LoRA, from the training
checkpoint (each rank only its tensor-parallel pieces), folds LoRA in and generates greedily: the tokens must be
exactly those of one-process Hugging Face generate on the merged weights and on base + adapter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.test_finetune_lora import BUNDLED, model_dirs  # noqa: F401 - the fixture
from tests.distributed.test_multinode import child_env, launcher_cmd, run_ok
from tests.harness import run_distributed
from tests.rank_zygote import HF_PRELOAD, routing

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from examples.finetune_llm import data as sft  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]

STEPS, NEW_TOKENS = 12, 12
PROMPTS = [p["prompt"] for p in sft.load_pairs(BUNDLED / "data" / "pairs.jsonl")[:4]]


@pytest.fixture(scope="module")
def trained(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    out = tmp_path_factory.mktemp("lora_run")
    args = ["--model", str(model_dirs["llama"]), "--output_dir", str(out), "--save_dir", str(out / "checkpoints"),
            "--steps", str(STEPS), "--save_interval", str(STEPS), "--eval_interval", "0", "--samples", "1",
            "--max_new_tokens", "4", "--max_seq_len", "48", "--lr", "2e-2", "--merge"]
    run_ok(launcher_cmd(["--num_gpus", "2", str(BUNDLED / "train.py"), *args]), out, {**child_env(), **routing(HF_PRELOAD)})
    assert (out / "checkpoints" / "latest").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    return {"base": model_dirs["llama"], "checkpoint": out / "checkpoints", "adapter": out / "adapter",
            "merged": out / "merged"}


def _batch(tokenizer) -> dict[str, torch.Tensor]:
    """The prompts as one left-padded batch, formatted as in training."""
    rows = [sft.prompt_ids(tokenizer, p, "chat") for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


def _generate(model, tokenizer) -> torch.Tensor:
    return model.generate(**_batch(tokenizer), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def _serve(paths: dict[str, Path], tp: int) -> dict:
    from shardwise.inference import load_pretrained

    tokenizer = transformers.AutoTokenizer.from_pretrained(paths["adapter"])
    engine = load_pretrained(paths["base"], checkpoint=paths["checkpoint"], adapter=paths["adapter"],
                             tensor_parallel={"tp_size": tp}, dtype=torch.float32, max_out_tokens=128)
    q_proj = engine.module.get_parameter("model.layers.0.self_attn.q_proj.weight")
    lora_left = [n for n, _ in engine.module.named_parameters() if "lora_" in n]
    return {"tokens": _generate(engine, tokenizer), "q_proj": tuple(q_proj.shape), "lora_left": lora_left}


def test_lora_checkpoint_served_at_tp2_matches_hugging_face(trained: dict[str, Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(trained["adapter"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(trained["merged"], dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, trained["adapter"]).eval()
    with torch.no_grad():
        expected = _generate(merged, tokenizer)
        assert torch.equal(_generate(adapted, tokenizer), expected)
        untrained = _generate(transformers.AutoModelForCausalLM.from_pretrained(trained["base"]), tokenizer)
    assert not torch.equal(untrained, expected)  # the adapter changes what is generated

    ranks = run_distributed(_serve, 2, trained, 2, timeout=240)
    for out in ranks:
        assert torch.equal(out["tokens"], expected), (out["tokens"], expected)
        assert out["q_proj"] == (16, 32) and not out["lora_left"]  # split over the 2 ranks, LoRA folded in
    assert torch.equal(run_distributed(_serve, 1, trained, 1, timeout=240)[0]["tokens"], expected)
