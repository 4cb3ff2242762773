"""Tiny Hugging Face causal LMs for the inference tests, built locally (never downloaded), and their oracle.

Each kind covers a different way a model is split and loaded: LLaMA (grouped-query attention, 8 query heads over
4 key/value heads so it splits 4 ways), GPT-2 (transformers' Conv1D, the fused q/k/v `c_attn` split as 3 blocks,
embedding tied to the LM head), OPT (biases, learned positions) and Qwen2 (q/k/v biases, `tie_word_embeddings`).
Weights are drawn with a wide init (`initializer_range` 0.2) so that greedy decoding does not settle on one
repeated token, which would make token equality a weak check.

The oracle is the same model in one process: `oracle_generate` is Hugging Face's own `generate`, `oracle_logits`
its forward. Folders are written by `save_folder` (`save_pretrained`, safetensors, several shards) and read back
on meta by `empty_model`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

KINDS = ("llama", "gpt2", "opt", "qwen2")
VOCAB, NEW_TOKENS = 256, 20
SHARD_SIZE = "40KB"
"""save_pretrained's max_shard_size: every model spans several files (as a real one does)."""


def hf_config(kind: str) -> Any:
    import transformers

    common = {"vocab_size": VOCAB, "max_position_embeddings": 64, "initializer_range": 0.2, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2}
    if kind == "llama":
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                                        **common)
    if kind == "gpt2":
        common.pop("max_position_embeddings")
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if kind == "opt":
        return transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                      word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        tie_word_embeddings=True, **common)
    raise ValueError(f"kind: one of {KINDS}; got {kind!r}.")


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """The whole model (fp32, SDPA attention, eval mode), its weights drawn after `torch.manual_seed(seed)`."""
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config(kind), attn_implementation="sdpa").eval()


def save_folder(model: torch.nn.Module, path: str | Path) -> Path:
    """`model` as a Hugging Face folder of safetensors shards (with model.safetensors.index.json)."""
    model.save_pretrained(path, max_shard_size=SHARD_SIZE, safe_serialization=True)
    return Path(path)


def empty_model(folder: str | Path | None = None, config: Any = None) -> torch.nn.Module:
    """The model of a folder (or of a config) built on the meta device (no weights), as `load_pretrained` builds it."""
    import transformers

    from shardwise.inference import empty_weights

    config = config if config is not None else transformers.AutoConfig.from_pretrained(folder)
    with empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def prompts() -> dict[str, torch.Tensor]:
    """A batch of two prompts, the second shorter and padded on the left (pad id 0), as generation wants."""
    ids = torch.tensor([[1, 17, 90, 33, 7, 201, 45], [0, 0, 1, 8, 122, 64, 9]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def greedy_kwargs(new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}


def sample_kwargs(new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": True, "top_k": 0,
            "top_p": 1.0, "temperature": 1.0, "pad_token_id": 0}


def oracle_generate(model: torch.nn.Module, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**prompts(), **kwargs)


def oracle_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**prompts()).logits


def engine_logits(engine: Any) -> torch.Tensor:
    return engine(**prompts()).logits


def assert_close_logits(got: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5, label: str = "") -> None:
    """Within `rtol` of the logits' scale (fp32: the split only reorders sums)."""
    assert got.shape == ref.shape, f"{label}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    error, scale = (got.float() - ref.float()).abs().max().item(), ref.abs().max().item()
    assert error <= rtol * scale, f"{label}: logits off by {error} (scale {scale})"
