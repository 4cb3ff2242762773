"""`shardwise plan --model M --config ds.json --world N`: the planned per-rank peak, by parts."""

from __future__ import annotations

import argparse
import json
import sys

from ..config.parse import load_raw
from ..profiling.units import binary_bytes
from .models import parse_model_args, profile
from .plan import plan


def main(argv: list[str] | None = None, prog: str = "shardwise plan") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Per-rank peak memory of a training config, by parts, "
                                     "before the run: model states, gradient staging, ZeRO-3's window, activations.")
    parser.add_argument("--model", required=True,
                        help="a Hugging Face config.json (or its directory), or package.module:factory")
    parser.add_argument("--model_arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the factory (repeatable)")
    parser.add_argument("--config", required=True, help="the DeepSpeed-format JSON config")
    parser.add_argument("--world", type=int, default=1, help="data-parallel ranks")
    parser.add_argument("--seq_len", type=int, default=None, help="tokens per sample (default: the model's maximum)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world: at least 1; got {args.world}.")
    try:
        shape, activations, how = profile(args.model, parse_model_args(args.model_arg), args.seq_len)
        memory = plan(shape, load_raw(args.config), args.world, activations)
    except ValueError as e:  # the user's arguments or config: the message names the fix
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**memory.to_json(), "model": shape.to_json() | {"module_sizes": len(shape.module_sizes)},
                          "activations": activations.to_json()}, indent=2))
        return 0
    print(memory.table())
    print(f"{shape.trainable / 1e6:.1f}M trainable, {shape.frozen / 1e6:.1f}M frozen parameters; activations "
          f"{binary_bytes(activations.saved_bytes)} per sample at {activations.seq_len} tokens, {how}.")
    return 0
