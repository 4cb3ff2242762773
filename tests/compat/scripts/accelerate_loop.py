"""A training loop written for accelerate with its DeepSpeed plugin, as accelerate's docs write them: a
DeepSpeed config with "auto" values, `accelerator.prepare`, `accelerator.accumulate`, `accelerator.backward`.
--plugin builds `DeepSpeedPlugin(hf_ds_config=...)` in the script; without it, `accelerate launch
--use_deepspeed` (or nothing: the oracle, plain accelerate) decides. Prints `RESULT <json>` on rank 0."""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

VOCAB, SEQ = 64, 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plugin", action="store_true")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    plugin = None
    if args.plugin:
        plugin = DeepSpeedPlugin(hf_ds_config={
            "zero_optimization": {"stage": args.stage, "reduce_bucket_size": "auto"},
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto"})
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, 1, args.steps)
    data = [torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i)) for i in range(64)]
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses, micro = [], 0
    for ids in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # under DeepSpeed the config's gradient_clipping ("auto": 1.0) does it
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        micro += 1
        losses.append(accelerator.gather(loss.detach()).mean().item())
        if micro == 2 * args.steps:
            break
    if accelerator.is_main_process:
        print("RESULT " + json.dumps({"losses": losses, "engine": type(model).__name__}), flush=True)


if __name__ == "__main__":
    main()
