"""Fine-tune a Hugging Face causal LM on prompt/response pairs, with LoRA (peft) or fully, through shardwise.

    python examples/finetune_llm/make_assets.py --base checkpoints/finetune_llm/base     # a tiny base model
    shardwise --num_gpus 2 examples/finetune_llm/train.py --model checkpoints/finetune_llm/base
    torchrun --nproc_per_node 2 examples/finetune_llm/train.py --model ... --deepspeed_config my_ds.json
    shardwise --hostfile hosts examples/finetune_llm/train.py ...          # across nodes; `shardwise k8s` alike

The loss is the mean next-token cross-entropy over the response tokens of the whole optimizer step
(every micro-batch on every rank): each rank scales its token-loss sum by the step's global token
count, so the result equals one process training on the whole batch, whatever the padding or the
number of response tokens per rank. At ZeRO-3 the model is partitioned while it is built and its
weights streamed in (see model_io.py). Rank 0 shows a progress bar; every --eval_interval steps the
held-out loss and perplexity; every --save_interval steps a checkpoint (--resume continues from the
newest); at the end the LoRA adapter (peft) and, with --merge (always when training fully), merged
weights that `from_pretrained` loads, then greedy completions of a few held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a path (python examples/finetune_llm/train.py), not as a module
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardwise as deepspeed  # noqa: E402
from examples.finetune_llm import data as sft  # noqa: E402
from examples.finetune_llm import model_io  # noqa: E402
from examples.step_bar import StepBar  # noqa: E402
from shardwise.config import parse_config  # noqa: E402
from shardwise.runtime.activation_checkpointing import Checkpointer, use_hf_layers  # noqa: E402
from shardwise.runtime.data import RepeatingLoader, move_to_device  # noqa: E402

HERE = Path(__file__).resolve().parent
Batch = dict[str, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", required=True, help="Hugging Face model directory (config, tokenizer, safetensors)")
    add("--data", default=str(HERE / "data" / "pairs.jsonl"), help="prompt/response JSONL")
    add("--eval_data", help="held-out JSONL (default: --eval_fraction of --data)")
    add("--eval_fraction", type=float, default=0.1, help="share of --data held out when --eval_data is not given")
    add("--template", choices=["auto", "chat", "plain"], default="auto",
        help="chat: the tokenizer's chat template; plain: prompt + response; auto: chat if the tokenizer has one")
    add("--max_seq_len", type=int, default=128, help="tokens per sequence (longer pairs are truncated)")
    add("--packing", action="store_true", help="pack pairs into rows of exactly --max_seq_len tokens")
    add("--mode", choices=["lora", "full"], default="lora", help="train LoRA adapters or every parameter")
    add("--lora_r", type=int, default=16)
    add("--lora_alpha", type=float, default=32.0)
    add("--lora_dropout", type=float, default=0.05)
    add("--lora_target_modules", default=",".join(model_io.DEFAULT_TARGETS),
        help="comma-separated module names, or all-linear")
    add("--gradient_checkpointing", action="store_true",
        help="recompute each decoder layer in backward (also on when the config has an activation_checkpointing section)")
    add("--steps", type=int, default=300, help="optimizer steps; also the scheduler's total_num_steps")
    add("--eval_interval", type=int, default=50, help="held-out loss every N steps (0: only at the end)")
    add("--save_interval", type=int, default=100, help="checkpoint every N steps into --save_dir (0: never)")
    add("--save_dir", default="checkpoints/finetune_llm/run", help="checkpoints (for --resume)")
    add("--resume", action="store_true", help="continue from the newest checkpoint in --save_dir, if any")
    add("--output_dir", default="checkpoints/finetune_llm/out", help="adapter/ and merged/ are written here")
    add("--merge", action="store_true", help="also write merged full weights (LoRA folded in) for from_pretrained")
    add("--merged_dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    add("--config", default=str(HERE / "ds_config.json"), help="DeepSpeed-format JSON (--deepspeed_config wins)")
    add("--zero_stage", type=int, choices=[0, 1, 2, 3], help="override zero_optimization.stage")
    add("--offload", choices=["none", "cpu", "nvme"], help="override offload_optimizer and offload_param devices")
    add("--nvme_path", default="/local_nvme", help="with --offload nvme")
    add("--bf16", action="store_true", help="override: bf16 parameters and activations")
    add("--lr", type=float, help="override the optimizer's lr (and the scheduler's peak)")
    add("--samples", type=int, default=3, help="held-out prompts to complete (greedy) at the end")
    add("--max_new_tokens", type=int, default=24)
    add("--seed", type=int, default=1234)
    add("--local_rank", type=int, default=-1, help="passed by the launcher; LOCAL_RANK in the env is used")
    deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON config with the command-line overrides applied (offload keys pass straight through)."""
    cfg = json.loads(Path(args.deepspeed_config or args.config).read_text())
    zero = cfg.setdefault("zero_optimization", {})
    if args.zero_stage is not None:
        zero["stage"] = args.zero_stage
    if args.offload is not None:
        for key in ("offload_optimizer", "offload_param"):
            zero[key] = {"device": args.offload, **({"nvme_path": args.nvme_path} if args.offload == "nvme" else {})}
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    scheduler = cfg.get("scheduler", {})
    if scheduler.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        scheduler.setdefault("params", {})["total_num_steps"] = args.steps
    if args.lr is not None:
        cfg.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
        if "warmup_max_lr" in scheduler.get("params", {}):
            scheduler["params"]["warmup_max_lr"] = args.lr
    cfg.setdefault("seed", args.seed)
    return cfg


def enable_gradient_checkpointing(model: torch.nn.Module, section: Any = None) -> Checkpointer:
    """Recompute each decoder layer in backward with shardwise's checkpointer (the config's
    `activation_checkpointing` section: cpu_checkpointing, profile, ...) through Hugging Face's hook.

    The reentrant flavour (DeepSpeed's): it recomputes under a backward of its own, whose graph carries
    the ZeRO-3 hooks, so the recomputed forward gathers the partitioned parameters again.
    """
    checkpointer = Checkpointer(section)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    use_hf_layers(base, checkpointer)
    return checkpointer


def build_model(args: argparse.Namespace, zero_stage: int, checkpointing: Any = None) -> torch.nn.Module:
    """The model to train; `checkpointing` (an `activation_checkpointing` section) turns on recomputation."""
    torch.manual_seed(args.seed)  # LoRA's initial A matrices: the same on every rank
    model = model_io.load_model(args.model, zero_stage)
    if args.gradient_checkpointing or checkpointing is not None:
        enable_gradient_checkpointing(model, checkpointing)
    if args.mode == "lora":
        targets = args.lora_target_modules
        model = model_io.add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout,
                                  targets if targets == "all-linear" else targets.split(","))
    return model


def train_step(engine: Any, micro_batches: list[Batch]) -> tuple[float, int]:
    """One optimizer step over this rank's micro-batches; returns (mean response-token loss, tokens)
    over all ranks."""
    dp = engine.topology.data
    counts = torch.tensor([float(sum(sft.target_count(b["labels"]) for b in micro_batches))])
    dist.all_reduce(counts, group=dp.pg)
    factor = dp.size * engine.gradient_accumulation_steps() / max(counts.item(), 1.0)
    loss_sum, tokens = 0.0, 0
    for batch in micro_batches:
        batch = move_to_device(batch, engine.device)
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        local = sft.token_loss_sum(logits, batch["labels"])
        engine.backward(local * factor)  # the engine averages over ranks and micro-batches: undo both
        engine.step()
        loss_sum += local.item()
        tokens += int(batch["attention_mask"].sum())
    totals = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64)
    dist.all_reduce(totals, group=dp.pg)
    return totals[0].item() / max(counts.item(), 1.0), int(totals[1].item())


@torch.no_grad()
def evaluate(engine: Any, batches: list[Batch]) -> tuple[float, float]:
    """Held-out (loss, perplexity): batches dealt round-robin to the ranks; a rank whose turn has no batch
    runs one anyway and discards it, so that at ZeRO-3 every rank's gathers stay in step."""
    dp = engine.topology.data
    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(batches), dp.size):
        index = start + dp.rank
        batch = move_to_device(batches[index if index < len(batches) else 0], engine.device)
        logits = engine.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if index < len(batches):
            totals += torch.tensor([sft.token_loss_sum(logits, batch["labels"]).item(), sft.target_count(batch["labels"])],
                                   dtype=torch.float64)
    engine.train()
    dist.all_reduce(totals, group=dp.pg)
    loss = totals[0].item() / max(totals[1].item(), 1.0)
    return loss, math.exp(min(loss, 50.0))


def make_datasets(args: argparse.Namespace, tokenizer: Any) -> tuple[sft.SFTDataset, list[Batch], list[dict]]:
    pairs = sft.load_pairs(args.data)
    if args.eval_data:
        train_pairs, eval_pairs = pairs, sft.load_pairs(args.eval_data)
    else:
        train_pairs, eval_pairs = sft.split_pairs(pairs, args.eval_fraction, args.seed)
    train = sft.encode_all(tokenizer, train_pairs, args.template, args.max_seq_len)
    held_out = sft.encode_all(tokenizer, eval_pairs, args.template, args.max_seq_len)
    if args.packing:
        train, held_out = sft.pack(train, args.max_seq_len), sft.pack(held_out, args.max_seq_len) or held_out[:1]
    collate = sft.PadCollator(tokenizer.pad_token_id)
    eval_batches = [collate(held_out[i:i + 8]) for i in range(0, len(held_out), 8)]
    return sft.SFTDataset(train), eval_batches, eval_pairs


def next_batch(batches: Any) -> Batch:
    """The next micro-batch, leaving torch's global RNG as it was.

    Starting an epoch, the loader's DataLoader draws a worker seed from the global RNG; a run resumed
    mid-epoch starts its iterator after the checkpoint restored that RNG, so the draw would shift every
    later dropout mask. Keeping data loading out of the model's RNG stream makes the resume exact.
    """
    state = torch.get_rng_state()
    batch = next(batches)
    torch.set_rng_state(state)
    return batch


def train(args: argparse.Namespace, engine: Any, loader: Any, eval_batches: list[Batch]) -> list[float]:
    """Steps up to --steps; returns each step's training loss."""
    rank0 = engine.global_rank == 0
    batches = RepeatingLoader(loader)  # made after a resume has positioned the loader
    seconds, tokens, losses = 0.0, 0, []
    # shardwise's own step lines print above the bar, so they do not break it.
    with StepBar(args.steps, initial=engine.global_steps, enabled=rank0) as bar:
        while engine.global_steps < args.steps:
            start = time.perf_counter()
            loss, step_tokens = train_step(engine, [next_batch(batches) for _ in range(engine.gradient_accumulation_steps())])
            seconds += time.perf_counter() - start
            tokens += step_tokens
            losses.append(loss)
            step = engine.global_steps
            bar.update(loss=f"{loss:.3f}", tok_s=f"{tokens / seconds:,.0f}", lr=f"{engine.get_lr()[0]:.2e}")
            if (args.eval_interval and step % args.eval_interval == 0) or step == args.steps:
                eval_loss, ppl = evaluate(engine, eval_batches)
                bar.write(f"step {step:>5}: held-out loss {eval_loss:.3f}, perplexity {ppl:.2f}")
            if args.save_interval and step % args.save_interval == 0:
                engine.save_checkpoint(args.save_dir, tag=f"global_step{step}")
    return losses


def finish(args: argparse.Namespace, engine: Any, tokenizer: Any, eval_pairs: list[dict]) -> None:
    out = Path(args.output_dir)
    dtype = getattr(torch, args.merged_dtype)
    if args.mode == "lora":
        model_io.save_adapter(engine.module, out / "adapter", base_model=args.model, tokenizer=tokenizer)
    if args.merge or args.mode == "full":
        model_io.save_merged(engine.module, out / "merged", dtype=dtype, tokenizer=tokenizer)
    engine.module.config.use_cache = True
    prompts = [p["prompt"] for p in eval_pairs[:args.samples]]
    completions = model_io.greedy_completions(engine.module, tokenizer, prompts, args.template, args.max_new_tokens)
    if engine.global_rank == 0:
        print(f"saved to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
        for prompt, ids in zip(prompts, completions):
            print(f"--- {' '.join(prompt.split())}\n    {tokenizer.decode(ids, skip_special_tokens=True).strip()}")


def main(argv: list[str] | None = None) -> None:
    import transformers

    args = parse_args(argv)
    deepspeed.init_distributed()
    config = load_config(args)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    if args.template == "auto":
        args.template = "chat" if tokenizer.chat_template else "plain"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_set, eval_batches, eval_pairs = make_datasets(args, tokenizer)
    parsed = parse_config(config, dp_size=dist.get_world_size())  # a bad config fails before the model loads
    checkpointing = parsed.activation_checkpointing if "activation_checkpointing" in config else None
    model = build_model(args, parsed.zero_optimization.stage, checkpointing)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Counted before initialize: at ZeRO-3 the engine leaves empty placeholders in the module.
    n_trainable = sum(p.numel() for p in trainable) if args.mode == "lora" else model_io.stored_numel(args.model)
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=trainable, training_data=train_set,
                                                collate_fn=sft.PadCollator(tokenizer.pad_token_id), config=config)
    if args.resume and (Path(args.save_dir) / "latest").is_file():
        path, _ = engine.load_checkpoint(args.save_dir)
        if engine.global_rank == 0:
            print(f"resumed from {path} at step {engine.global_steps}")
    if engine.global_rank == 0:
        print(f"{args.mode} fine-tuning of {args.model}: {n_trainable:,} trainable parameters of "
              f"{model_io.stored_numel(args.model):,}, {len(train_set)} training sequences, {engine.world_size} "
              f"process(es), ZeRO stage {engine.config.zero_optimization.stage}, {args.steps} steps")
    train(args, engine, loader, eval_batches)
    finish(args, engine, tokenizer, eval_pairs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
