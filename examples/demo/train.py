"""Train the demo GPT on the bundled King James text through shardwise's DeepSpeed API.

    shardwise --num_gpus 2 examples/demo/train.py    # two processes (CPU processes without GPUs)
    python examples/demo/train.py --steps 100        # one process

Rank 0 shows a progress bar (loss, tokens/s summed over all ranks, lr, ETA) and the validation loss every
--eval_interval steps; at the end every rank saves its part of the checkpoint and rank 0 prints greedy text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a path (python examples/demo/train.py), not as a module
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardwise as deepspeed  # noqa: E402
from examples.demo.data import TextDataset  # noqa: E402
from examples.demo.model import GPT, PRESETS, preset  # noqa: E402
from examples.demo.tokenizer import ByteTokenizer  # noqa: E402
from examples.step_bar import StepBar  # noqa: E402
from shardwise.runtime.data import RepeatingLoader  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--preset", default="demo", choices=sorted(PRESETS), help="model size (see examples/demo/model.py)")
    add("--steps", type=int, default=300, help="optimizer steps; also the scheduler's total_num_steps")
    add("--seq_len", type=int, default=128, help="tokens (bytes) per training window")
    add("--save_dir", default="checkpoints/demo", help="checkpoint directory, written at the end")
    add("--config", default=str(Path(__file__).resolve().parent / "ds_config.json"),
        help="DeepSpeed-format JSON config (--deepspeed_config takes precedence)")
    add("--eval_interval", type=int, default=50, help="validation every N steps")
    add("--eval_batches", type=int, default=4, help="micro-batches per validation")
    add("--prompt", default="And God said", help="prompt for the text sample printed at the end")
    add("--sample_bytes", type=int, default=200, help="bytes to generate after the prompt")
    add("--seed", type=int, default=1234, help="model initialization seed")
    add("--local_rank", type=int, default=-1, help="passed by the launcher; LOCAL_RANK in the env is used")
    deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON config, with the cosine schedule stretched to end where this run ends (--steps)."""
    cfg = json.loads(Path(args.deepspeed_config or args.config).read_text())
    scheduler = cfg.get("scheduler", {})
    if scheduler.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        scheduler.setdefault("params", {})["total_num_steps"] = args.steps
    return cfg


def validation_batches(seq_len: int, micro_batch: int, n_batches: int) -> list[Batch]:
    """Fixed batches spread evenly over the validation split, identical on every rank."""
    val = TextDataset(seq_len=seq_len, split="val")
    count = min(len(val), micro_batch * n_batches)
    windows = [val[int(i)] for i in torch.linspace(0, len(val) - 1, count).long()]
    return [
        (torch.stack([x for x, _ in chunk]), torch.stack([y for _, y in chunk]))
        for chunk in (windows[i : i + micro_batch] for i in range(0, count, micro_batch))
    ]


@torch.no_grad()
def evaluate(engine: Any, batches: list[Batch]) -> float:
    # Every rank runs the same forwards, so a sharded model (ZeRO-3) gathers its parameters in step.
    engine.eval()
    losses = [engine.module(x.to(engine.device), y.to(engine.device)).item() for x, y in batches]
    engine.train()
    return sum(losses) / len(losses)


def train(args: argparse.Namespace, engine: Any, loader: Any, val: list[Batch]) -> None:
    rank0 = engine.global_rank == 0
    tokens_per_step = engine.train_batch_size() * args.seq_len  # all ranks, all micro-batches
    batches = RepeatingLoader(loader)
    train_seconds, last_step = 0.0, engine.global_steps
    # shardwise's own step lines print above the bar, so they do not break it.
    with StepBar(args.steps, initial=engine.global_steps, enabled=rank0) as bar:
        while engine.global_steps < args.steps:
            start = time.perf_counter()
            input_ids, labels = (t.to(engine.device) for t in next(batches))
            loss = engine(input_ids, labels)
            engine.backward(loss)
            engine.step()
            train_seconds += time.perf_counter() - start
            if engine.global_steps == last_step:
                continue  # inside a gradient-accumulation window: no optimizer step yet
            last_step = engine.global_steps
            rate = (last_step * tokens_per_step) / train_seconds
            bar.update(loss=f"{loss.item():.3f}", tok_s=f"{rate:,.0f}", lr=f"{engine.get_lr()[0]:.2e}")
            if last_step % args.eval_interval == 0 or last_step == args.steps:
                val_loss = evaluate(engine, val)
                bar.write(f"step {last_step:>5}: validation loss {val_loss:.3f}")


def sample(engine: Any, prompt: str, n_bytes: int) -> str:
    """Greedy text from the trained model; run on every rank so a sharded model stays in step."""
    tokenizer = ByteTokenizer()
    prompt_ids = torch.tensor([tokenizer.encode(prompt)], device=engine.device)
    engine.eval()
    ids = engine.module.generate(prompt_ids, n_bytes)
    engine.train()
    return tokenizer.decode(ids[0].tolist())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)  # same initial weights on every rank (the engine also broadcasts rank 0's)
    model = GPT(preset(args.preset, seq_len=args.seq_len))
    engine, _, loader, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.param_groups(),
        training_data=TextDataset(seq_len=args.seq_len, split="train"),
        config=load_config(args),
    )
    rank0 = engine.global_rank == 0
    if rank0:
        print(f"{args.preset}: {model.num_parameters():,} parameters, {engine.world_size} process(es), "
              f"{engine.train_batch_size()} sequences of {args.seq_len} bytes per step, {args.steps} steps")
    val = validation_batches(args.seq_len, engine.train_micro_batch_size_per_gpu(), args.eval_batches)
    train(args, engine, loader, val)
    tag = f"global_step{engine.global_steps}"
    engine.save_checkpoint(args.save_dir, tag=tag)
    text = sample(engine, args.prompt, args.sample_bytes)
    if rank0:
        print(f"checkpoint saved to {Path(args.save_dir) / tag}")
        print(f"sample (greedy, {args.sample_bytes} bytes):\n{text}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
