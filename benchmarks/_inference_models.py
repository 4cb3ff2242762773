"""The models `inference.py` measures, written as Hugging Face folders (safetensors, sharded, with an index), and the
pieces every rank shares: prompts, the generation keywords, a timestamping logits processor, perplexity.

- `tiny`: the fine-tuning example's LLaMA (examples/finetune_llm/tiny_llama/config.json, 0.87M parameters),
  random weights.
- `bench100m`: a LLaMA-style config of ~110M parameters (hidden 768, 12 layers, 12 heads, SwiGLU 2048, vocabulary
  32000, tied embeddings), random weights; `small` is its quick stand-in (hidden 256, 2 layers, vocabulary 8000).
- `trained`: the tiny LLaMA pretrained exactly as `examples/finetune_llm/make_assets.py --base` does (same seed,
  steps, optimizer, windows) but on the first `1 - holdout` of the KJV text only: make_assets samples its windows
  from the whole text and holds nothing out, so the benchmark keeps the tail unseen for the perplexity.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from _harness import REPO_ROOT

TINY_DIR = REPO_ROOT / "examples" / "finetune_llm" / "tiny_llama"
TEXT = REPO_ROOT / "examples" / "demo" / "data" / "kjv_genesis_to_2samuel.txt"
LLAMA_100M = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
              "intermediate_size": 2048, "vocab_size": 32000, "tie_word_embeddings": True,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "pad_token_id": 0, "bos_token_id": 1,
              "eos_token_id": 2}
SHAPES = {"bench100m": LLAMA_100M,
          "small": {**LLAMA_100M, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "intermediate_size": 688, "vocab_size": 8000}}
DTYPES = ("fp32", "bf16")


def write_random(name: str, folder: Path, seed: int = 0) -> dict[str, Any]:
    """A randomly initialised model `name` ("tiny" or a key of SHAPES) saved under `folder` in several shards."""
    import torch
    import transformers

    if name == "tiny":
        config = transformers.AutoConfig.from_pretrained(TINY_DIR)
    else:
        config = transformers.LlamaConfig(**SHAPES[name])
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    weight = params * 4
    model.save_pretrained(folder, max_shard_size=max(weight // 4, 1 << 20))  # ~4 shards and an index
    return {"parameters": params, "config": {k: getattr(config, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "vocab_size", "tie_word_embeddings")}, "shards": len(list(folder.glob("*.safetensors"))), "seed": seed}


def write_trained(folder: Path, steps: int, holdout: float, seed: int = 0) -> dict[str, Any]:
    """make_assets' base model, pretrained on the text but its tail; the tail's token ids go to heldout.json."""
    import torch
    import transformers

    from examples.finetune_llm.make_assets import _pretrain

    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(TINY_DIR))
    ids = torch.tensor(tokenizer(TEXT.read_text(), add_special_tokens=False).input_ids)
    cut = int(ids.numel() * (1 - holdout))
    started = time.perf_counter()
    if steps:
        _pretrain(model, ids[:cut], steps, seq_len=128, batch=16)
    model.save_pretrained(folder, max_shard_size=1 << 20)
    (folder / "heldout.json").write_text(json.dumps(ids[cut:].tolist()))
    return {"pretrain_steps": steps, "text_tokens": ids.numel(), "train_tokens": cut,
            "heldout_tokens": ids.numel() - cut, "pretrain_s": round(time.perf_counter() - started, 1), "seed": seed}


def prompts(vocab: int, batch: int, length: int, seed: int = 0) -> Any:
    """`batch` prompts of `length` random ids, none of them the special ids 0-2 (pad, bos, eos)."""
    import torch

    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate_kwargs(ids: Any, new: int, pad: int) -> dict[str, Any]:
    """Greedy, exactly `new` tokens (an early end-of-sequence would shorten one library's run)."""
    import torch

    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": new, "min_new_tokens": new,
            "do_sample": False, "pad_token_id": pad}


def stamping_processor(stamps: list[float]) -> Any:
    """A logits processor that changes nothing and notes when each step's logits are ready: the first stamp ends
    the prefill, the ones after it the decoding steps."""
    import transformers

    class Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            stamps.append(time.perf_counter())
            return scores

    return transformers.LogitsProcessorList([Stamp()])


def perplexity(model: Any, ids: list[int], seq_len: int, windows: int, batch: int = 8) -> dict[str, Any]:
    """exp(mean next-token loss) over the first `windows` non-overlapping windows of `seq_len` tokens of `ids`;
    logits are taken to fp32 before the loss, so only the model's own arithmetic differs between dtypes."""
    import torch

    count = min(windows, len(ids) // seq_len)
    data = torch.tensor(ids[:count * seq_len]).view(count, seq_len)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for lo in range(0, count, batch):
            x = data[lo:lo + batch]
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1), reduction="sum")
            total, tokens = total + loss.item(), tokens + x[:, 1:].numel()
    return {"perplexity": round(math.exp(total / tokens), 4), "loss": round(total / tokens, 5), "tokens": tokens,
            "windows": count, "seq_len": seq_len}
