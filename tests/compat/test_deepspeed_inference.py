"""`deepspeed.init_inference` as DeepSpeed's inference tutorial uses it (tests/compat/scripts/inference_autotp.py),
at tensor-parallel size 2: greedy tokens equal one-process Hugging Face generate and the logits its forward; with
the real DeepSpeed (`make test-deepspeed`), the same tokens, logits and split shapes as DeepSpeed's AutoTP on CPU.
The LLaMA run is launched with the compatibility package's `deepspeed` command; the others get torchrun's
environment in a fork of a pre-imported interpreter (run.py), sparing each rank ~10 s of imports."""

from __future__ import annotations

import pytest
import torch

from tests.compat.run import deepspeed_python, run_script
from tests.compat.scripts.inference_autotp import NEW_TOKENS, batch, build

transformers = pytest.importorskip("transformers")
needs_deepspeed = pytest.mark.skipif(deepspeed_python() is None, reason="needs the real DeepSpeed: "
                                     "SHARDWISE_DEEPSPEED_PYTHON (set by `make test-deepspeed`, which .ci/run runs)")
MODELS = ["llama", "gpt2"]


def _oracle(kind: str) -> dict:
    model = build(kind)
    with torch.no_grad():
        tokens = model.generate(**batch(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        logits = model(**batch()).logits[:, -1]
    return {"tokens": tokens.tolist(), "logits": logits}


@pytest.mark.parametrize("kind", MODELS)
def test_init_inference_tp2_generates_like_hugging_face(kind):
    ours = run_script("inference_autotp.py", "--model", kind, world=2,
                      launcher="deepspeed" if kind == "llama" else "torchrun")
    oracle = _oracle(kind)
    assert ours["tokens"] == oracle["tokens"]
    torch.testing.assert_close(torch.tensor(ours["logits"]), oracle["logits"], rtol=1e-5, atol=1e-5)
    if kind == "llama":  # q_proj column-split, o_proj row-split
        assert ours["shapes"]["model.layers.0.self_attn.q_proj.weight"] == [32, 64]
        assert ours["shapes"]["model.layers.0.self_attn.o_proj.weight"] == [64, 32]


@pytest.mark.deepspeed_parity
@needs_deepspeed
@pytest.mark.parametrize("kind", ["llama"])  # DeepSpeed refuses AutoTP for GPT-2 (its kernel injection is CUDA-only)
def test_init_inference_matches_deepspeed(kind):
    # DeepSpeed's own launcher: under torchrun its CPU inference segfaults at start (its launcher sets up the
    # CPU runtime first)
    theirs = run_script("inference_autotp.py", "--model", kind, world=2, python=deepspeed_python(), timeout=600,
                        launcher="deepspeed")
    ours = run_script("inference_autotp.py", "--model", kind, world=2)
    assert ours["tokens"] == theirs["tokens"]
    torch.testing.assert_close(torch.tensor(ours["logits"]), torch.tensor(theirs["logits"]), rtol=1e-5, atol=1e-5)
    split = {n: s for n, s in theirs["shapes"].items() if n in ours["shapes"]}
    assert split and all(ours["shapes"][n] == s for n, s in split.items()), (ours["shapes"], theirs["shapes"])
