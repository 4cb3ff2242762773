"""AutoTP training written for DeepSpeed: a tiny LlamaForCausalLM built whole on every rank, `"tensor_parallel":
{"autotp_size": 2}` in the config, then the usual engine(batch) / backward / step loop. Every tensor-parallel
rank reads the same batch (its data-parallel slice). Prints `RESULT <json>` on rank 0."""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
import transformers

VOCAB, SEQ, BATCH = 64, 12, 4


def build(tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    dp = dist.get_world_size() // args.tp
    config = {"train_micro_batch_size_per_gpu": BATCH // dp, "gradient_accumulation_steps": 1,
              "gradient_clipping": args.clip, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "zero_optimization": {"stage": args.zero_stage}, "tensor_parallel": {"autotp_size": args.tp}}
    model = build(tie=False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dp_rank = dist.get_rank() // args.tp
    losses = []
    for step in range(args.steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        ids = ids[dp_rank * BATCH // dp : (dp_rank + 1) * BATCH // dp]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    if dist.get_rank() == 0:
        layer = engine.module.model.layers[0]
        shapes = {name: list(getattr(layer, part).get_submodule(name).weight.shape)
                  for part, name in (("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "down_proj"))}
        print("RESULT " + json.dumps({"losses": losses, "steps": engine.global_steps, "shapes": shapes}), flush=True)


if __name__ == "__main__":
    main()
