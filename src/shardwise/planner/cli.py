"""`shardwise plan --model M --config ds.json --world N`: the planned per-rank peak, by parts."""

from __future__ import annotations

import argparse
import json
import sys

from ..config.parse import load_raw
from ..profiling.units import binary_bytes
from .models import build, parse_model_args, profile
from .plan import plan
from .ranks import layout


def main(argv: list[str] | None = None, prog: str = "shardwise plan") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Per-rank peak memory of a training config, by parts, "
                                     "before the run: model states, gradient staging, ZeRO-3's window, activations.")
    parser.add_argument("--model", required=True,
                        help="a Hugging Face config.json (or its directory), or package.module:factory returning an "
                        "nn.Module")
    parser.add_argument("--model_arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the factory (repeatable)")
    parser.add_argument("--config", required=True, help="the DeepSpeed-format JSON config")
    parser.add_argument("--world", type=int, default=1,
                        help="processes of the run; the data-parallel ranks are world / (tensor-parallel size x "
                        "pipeline stages), as initialize divides them")
    parser.add_argument("--seq_len", type=int, default=None, help="tokens per sample (default: the model's maximum)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    for flag, value in (("--world", args.world), ("--seq_len", args.seq_len)):
        if value is not None and value < 1:
            parser.error(f"{flag}: at least 1; got {value}.")
    try:
        kwargs = parse_model_args(args.model_arg)
        ranks = layout(build(args.model, kwargs, "meta"), load_raw(args.config), args.world)
        shape, activations, how = profile(args.model, kwargs, args.seq_len, ranks)
        memory = plan(shape, ranks.config, ranks.data, activations)
    except ValueError as e:  # the user's arguments or config: the message names the fix
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**memory.to_json(), "model": shape.to_json() | {"module_sizes": len(shape.module_sizes)},
                          "activations": activations.to_json(),
                          "ranks": {"world": ranks.world, "tensor": ranks.tensor, "pipe": ranks.pipe,
                                    "data": ranks.data, "sequence": ranks.sequence}}, indent=2))
        return 0
    print(memory.table())
    if ranks.tensor > 1:
        print(f"Split over {ranks.tensor} tensor-parallel ranks as initialize splits it; {ranks.data} data-parallel "
              f"rank(s) of the {ranks.world} processes. Figures are tensor-parallel rank 0's.")
    if ranks.sequence > 1:
        print(f"Each sequence cut over {ranks.sequence} ranks (sequence_parallel_size): activations are a rank's "
              f"slice of {activations.seq_len} tokens; ZeRO partitions over all {ranks.data} data-parallel ranks.")
    print(f"{shape.trainable / 1e6:.1f}M trainable, {shape.frozen / 1e6:.1f}M frozen parameters; activations "
          f"{binary_bytes(activations.saved_bytes)} per sample at {activations.seq_len} tokens, {how}.")
    return 0
