"""Ulysses sequence parallelism in a plain accelerate training loop (no Trainer), turned on the way accelerate's
config file does it: `accelerate launch --config_file cfg.yaml accelerate_ulysses.py`, where the YAML's
distributed_type DEEPSPEED carries the ZeRO settings (or a deepspeed_config_file) and its parallelism_config the
sequence-parallel ones. The launcher turns those into PARALLELISM_CONFIG_* variables, and `Accelerator()` with no
parallelism arguments builds its ParallelismConfig from them. One `accelerator.prepare(model, optimizer, loader)`
makes accelerate register DeepSpeed's Ulysses attention and wrap the loader in UlyssesSPDataLoaderAdapter itself.
The loss is combined over the sequence group as a user of DeepSpeed's Ulysses writes it (the per-shard means
weighted by their unmasked tokens). Same model, samples and oracle as hf_trainer_ulysses.py (its docstring has the
sample mapping: at world size == sp, step m computes loader batch m). Prints `RESULT <json>` on rank 0."""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator

from tests.compat.scripts.hf_trainer_ulysses import Seen, Tokens, build_model


def sequence_group_loss(loss: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """The whole sequence's token-mean loss from each rank's shard mean, the same on every rank of the group; a
    shard with no unmasked label (its mean 0/0) counts for nothing."""
    from deepspeed.utils import groups

    group = groups._get_sequence_parallel_group()
    tokens = (shift_labels != -100).sum()
    losses = torch.stack(torch.distributed.nn.functional.all_gather(loss, group=group))
    counts = torch.stack(torch.distributed.nn.functional.all_gather(tokens, group=group))
    losses = torch.where(counts > 0, losses, torch.zeros_like(losses))
    return (losses * counts).sum() / counts.sum().clamp(min=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1, help="the loader's batch size (DeepSpeed's micro batch)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.2)
    args = p.parse_args()
    if not torch.cuda.is_available():
        # On CPU accelerate counts one process unless its state is made with cpu=True, and then starts
        # torch.distributed but not deepspeed.comm (which DeepSpeed's Ulysses setup asserts is up). The Trainer's
        # use_cpu=True does the same: PartialState(cpu=True) first, then Accelerator() picks DeepSpeed.
        import deepspeed
        from accelerate import PartialState

        deepspeed.init_distributed()
        PartialState(cpu=True)
    accelerator = Accelerator()
    world = accelerator.num_processes
    pc = accelerator.parallelism_config
    sp = pc.sp_size if pc is not None else 1
    model, data = build_model(), Tokens(args.steps * world * args.batch // sp)
    seen = Seen(data)
    model.register_forward_pre_hook(seen, with_kwargs=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for batch in loader:
        # DeepSpeed's adapter hands each rank its slice of the gathered rows, a strided view on CPU (its .cpu()
        # copies only from a GPU; the Trainer's input preparation copies too), and the model's loss .view()s
        # shift_labels: "view size is not compatible" at a batch of 2 without this
        batch = {k: v.contiguous() if torch.is_tensor(v) else v for k, v in batch.items()}
        # the labels come already shifted (shift_labels); the model computes its loss only when given labels
        outputs = model(**batch, labels=batch["shift_labels"])
        loss = sequence_group_loss(outputs.loss, batch["shift_labels"])
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, {"seen": seen.calls, "losses": losses})
    if accelerator.is_main_process:
        print("RESULT " + json.dumps({
            "losses": losses, "seen": [r["seen"] for r in everyone], "rank_losses": [r["losses"] for r in everyone],
            "engine": type(model).__name__, "loader": type(loader).__name__, "processes": world,
            "distributed_type": str(accelerator.distributed_type), "sp_size": sp,
            "sp_attn_implementation": pc.sp_handler.sp_attn_implementation if sp > 1 else None,
            "zero_stage": accelerator.deepspeed_config["zero_optimization"]["stage"],
            "gradient_clipping": accelerator.deepspeed_config.get("gradient_clipping", 0)}), flush=True)


if __name__ == "__main__":
    main()
