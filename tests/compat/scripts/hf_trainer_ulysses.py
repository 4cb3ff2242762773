"""Ulysses sequence parallelism through Hugging Face's Trainer, as users turn it on:
`TrainingArguments(deepspeed=<config>, parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N,
sp_handler=DeepSpeedSequenceParallelConfig(...)))` on a tiny LLaMA (GQA: 4 query heads, 2 key/value heads, sdpa,
fp32) built from a local config. Runs unchanged under the real DeepSpeed and under shardwise's compatibility
package; with --oracle it is the oracle instead: one process, whole sequences, a plain PyTorch loop over the
samples each optimizer step of the SP run sees (`step_batches`). Prints `RESULT <json>` on rank 0 (and writes it
to --result when given).

Which samples an optimizer step sees under SP (read from DeepSpeed 0.19.8's UlyssesSPDataLoaderAdapter and
transformers 5.24's Trainer; a run reports the samples every rank's forwards computed, `seen`, so the tests
check it too):
  - the Trainer's loader (train_sampling_strategy="sequential") cuts the dataset into batches of
    per_device_train_batch_size; accelerate deals them round-robin over all W processes (no device mesh under
    DeepSpeed SP): process p gets loader batches p, p+W, p+2W, ...
  - the adapter turns each process's batch into sp consecutive micro-steps of its SP group (ranks
    [g*sp, (g+1)*sp)): micro-step j of round k runs process g*sp+j's k-th batch on the whole group, each rank
    holding 1/sp of the sequence. So at W == sp, micro-step m runs loader batch m.
  - the Trainer counts micro-steps (it multiplies the loader's length by sp), so an optimizer step is
    gradient_accumulation_steps micro-steps; with dp = W/sp > 1 the dp groups' gradients are averaged.
  - a micro-step's loss is the mean over the valid tokens of the whole micro-batch (transformers'
    deepspeed_sp_compute_loss weighs each shard's mean by its count of labels != -100), the same on every SP
    rank; a step's loss and gradient are the mean over its micro-steps and dp groups.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 128, 32
# Masked prompt lengths (labels -100) by sample. At sp 2 the first half of the (shifted) targets holds
# 16 - max(p - 1, 0) unmasked tokens and the second 15 (32 - p past 17; its last position has no next token): the
# halves' counts differ, and at p = 20 the first half has none (its own mean loss is 0/0, which the weighted mean
# over shards has to skip).
PROMPTS = (0, 10, 20, 7, 2, 6, 0, 5)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1000 + i))
        labels = ids.clone()
        labels[:PROMPTS[i % len(PROMPTS)]] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ)}


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights in every process, with no file to share
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attention_dropout=0.0, attn_implementation="sdpa",
                         dtype=torch.float32)
    return LlamaForCausalLM(config)


def step_batches(steps: int, world: int, sp: int, batch: int, ga: int) -> list[list[list[int]]]:
    """Per optimizer step, the micro-batches (sample ids) whose losses and gradients it averages: GA micro-steps
    times dp groups (the mapping in the module docstring)."""
    dp, out = world // sp, []
    for step in range(steps):
        micro = []
        for m in range(step * ga, (step + 1) * ga):
            k, j = divmod(m, sp)  # round k of the adapter, micro-step j: process g*sp+j's k-th loader batch
            for g in range(dp):
                b = k * world + g * sp + j
                micro.append(list(range(b * batch, (b + 1) * batch)))
        out.append(micro)
    return out


def token_mean_loss(model, samples: list[int], data: Tokens) -> torch.Tensor:
    items = [data[i] for i in samples]
    ids = torch.stack([x["input_ids"] for x in items])
    labels = torch.stack([x["labels"] for x in items])
    logits = model(input_ids=ids, position_ids=torch.stack([x["position_ids"] for x in items])).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


def oracle(args: argparse.Namespace) -> dict:
    model, data = build_model(), Tokens(args.samples)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    plan = step_batches(args.steps, args.world, args.sp, args.per_device_train_batch_size, args.ga)
    losses, norms = [], []
    for micro in plan:
        loss = sum(token_mean_loss(model, s, data) for s in micro) / len(micro)
        (loss * args.grad_scale).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "steps": list(range(1, args.steps + 1)), "samples": plan}


def ds_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "steps_per_print": 2000, "wall_clock_breakdown": False}


class Seen:
    """The sample ids each forward on this rank computed (from its shard of input_ids), to check the mapping."""

    def __init__(self, data: Tokens) -> None:
        self.rows = {tuple(data[i]["input_ids"].tolist()): i for i in range(len(data))}
        self.calls: list[list[int]] = []

    def __call__(self, module, args, kwargs) -> None:
        if module.training:
            ids, pos = kwargs["input_ids"], kwargs["position_ids"]
            start = int(pos[0, 0])
            self.calls.append([next(i for row, i in self.rows.items()
                                    if list(row[start:start + ids.shape[1]]) == ids[b].tolist())
                               for b in range(ids.shape[0])])


def sequence_parallel(args: argparse.Namespace) -> dict | None:
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    cpu = not torch.cuda.is_available()
    if cpu:
        # On CPU accelerate starts torch.distributed but not deepspeed.comm, and DeepSpeed's
        # register_with_transformers asserts deepspeed.comm is up; without use_cpu accelerate counts one process
        # and gives every rank the whole dataset (each batch then trains sp times).
        import deepspeed

        deepspeed.init_distributed()
    # accelerate sizes DeepSpeed's train_batch_size with dp_shard_size (its default 1), not world / sp
    dp = torch.distributed.get_world_size() // args.sp
    parallelism = ParallelismConfig(
        sp_backend="deepspeed", sp_size=args.sp, dp_shard_size=dp, sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length=SEQ, sp_seq_length_is_variable=args.variable, sp_attn_implementation="sdpa"))
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.ga, max_steps=args.steps, learning_rate=args.lr, optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, train_sampling_strategy="sequential",
        deepspeed=ds_config(args.stage), parallelism_config=parallelism, use_cpu=cpu)
    model, data = build_model(), Tokens(args.samples)
    seen = Seen(data)
    model.register_forward_pre_hook(seen, with_kwargs=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer.train()
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, seen.calls)
    if torch.distributed.get_rank() != 0:
        return None
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h.get("grad_norm") for h in logs],
            "steps": [h["step"] for h in logs], "seen": everyone, "engine": type(trainer.model_wrapped).__name__,
            "processes": trainer.accelerator.num_processes}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--oracle", action="store_true", help="one process, whole sequences, plain PyTorch")
    p.add_argument("--world", type=int, default=2, help="(oracle) the SP run's process count")
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--variable", action="store_true", help="sp_seq_length_is_variable")
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--grad_scale", type=float, default=1.0, help="(oracle) the gradient applied, times the loss's")
    p.add_argument("--samples", type=int, default=None, help="the dataset's size (default: what --steps uses)")
    p.add_argument("--result", default=None, help="also write the RESULT json here")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    world = args.world if args.oracle else int(os.environ.get("WORLD_SIZE", 1))
    if args.samples is None:
        args.samples = args.steps * args.ga * world * args.per_device_train_batch_size // args.sp
    result = oracle(args) if args.oracle else sequence_parallel(args)
    if result is not None:
        text = json.dumps(result)
        if args.result:
            with open(args.result, "w") as f:
                f.write(text)
        print("RESULT " + text, flush=True)


if __name__ == "__main__":
    main()
