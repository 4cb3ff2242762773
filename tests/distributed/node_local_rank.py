"""One rank of tests/distributed/test_node_local_hosts.py, run inside a network-namespace host: LoRA on a tiny
LLaMA under ZeRO-3 with `offload_param`, reporting its losses, what the comms logger counted and what its
network interface sent. Prints `RESULT <json>`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

STEPS, MICRO, SEQ, WORLD = 4, 2, 16, 2
VOCAB = 128


def build():
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, lora)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (MICRO * WORLD, SEQ), generator=g)


def oracle() -> list[float]:
    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def sent_bytes(device: str) -> int:
    return int(Path(f"/sys/class/net/{device}/statistics/tx_bytes").read_text())


def main(device: str, node_local: bool) -> None:
    import torch.distributed as dist

    import shardwise

    model = build()
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "node_local_frozen_weights": node_local,
                                    "stage3_param_persistence_threshold": 0}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    rank = dist.get_rank()
    losses, per_step = [], []
    for step in range(STEPS):
        before = sent_bytes(device)
        ids = batch(step)[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
        per_step.append(sent_bytes(device) - before)
    stats = {f"{op}/{group}": s.bytes for (op, group), s in engine.comm.stats.ops.items()}
    print("RESULT " + json.dumps({"losses": losses, "sent_per_step": per_step, "frozen_bytes": frozen,
                                  "stats": stats}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "oracle":
        print("RESULT " + json.dumps({"losses": oracle()}))
    else:
        main(sys.argv[1], sys.argv[2] == "node-local")
