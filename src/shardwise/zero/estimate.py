"""`python -m shardwise.zero.estimate --params 1.3e9 --num_gpus 8`: model-state memory per rank, per stage."""

from __future__ import annotations

import argparse

from ..profiling.memory import describe_estimate


def main(argv: list[str] | None = None, prog: str = "python -m shardwise.zero.estimate") -> int:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Model-state memory per rank for Adam training under ZeRO.")
    parser.add_argument("--params", type=float, required=True, help="trainable parameters, e.g. 1.3e9")
    parser.add_argument("--num_gpus", type=int, default=1)
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--fp32", action="store_true", help="fp32 parameters (default: 16-bit with fp32 masters)")
    parser.add_argument("--offload", action="store_true", help="optimizer state in host memory")
    args = parser.parse_args(argv)
    for stage in (0, 1, 2, 3):
        print(describe_estimate(int(args.params), args.num_gpus * args.num_nodes, stage, args.offload, not args.fp32))
    return 0


if __name__ == "__main__":
    main()
