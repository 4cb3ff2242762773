"""DeepSpeed's inference tutorial pattern: a Hugging Face model built whole on every rank, handed to
`deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=..., replace_with_kernel_inject=False)`
(AutoTP), then `engine.generate` and `engine(input_ids)`. Every rank feeds the same batch: two prompts, one left
padded. Prints `RESULT <json>` on rank 0: the greedy tokens, the last position's logits, the split shapes."""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
import transformers

PROMPTS = [[1, 5, 9, 33, 7, 21], [0, 0, 1, 8, 12, 40]]
NEW_TOKENS = 16


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128, pad_token_id=0)
    else:
        cfg = transformers.LlamaConfig(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64,
                                       **common)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor(PROMPTS)
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    engine = deepspeed.init_inference(build(args.model), tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                      replace_with_kernel_inject=False)
    tokens = engine.generate(**batch(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        logits = engine(**batch()).logits[:, -1]
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters() if ".0." in n and "weight" in n}
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps({"tokens": tokens.tolist(), "logits": logits.tolist(), "shapes": shapes}),
              flush=True)


if __name__ == "__main__":
    main()
