"""`shardwise checkpoint inspect CKPT`, `... to-fp32 CKPT OUT`, `... export --to deepspeed --world N --stage S CKPT
OUT` and `... import CKPT OUT`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from .consolidate import consolidate
from .errors import CheckpointError
from .reader import CheckpointReader, open_checkpoint


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1024' → bytes."""
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    for suffix, factor in units.items():
        if text.upper().endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def inspect(args: argparse.Namespace) -> None:
    reader = open_checkpoint(args.checkpoint, args.tag, verify=False)
    meta = reader.meta
    if meta.get("origin") == "deepspeed" and not isinstance(reader, CheckpointReader):
        _inspect_deepspeed(reader)
        return
    print(f"{reader.path}: shardwise {meta['shardwise_version']}, format {meta['format_version']}, "
          f"world size {meta['world_size']}, ZeRO stage {meta['stage']}, step {meta['counters']['global_steps']}")
    sizes = ", ".join(f"{n} ({f['bytes'] / 2**20:.1f} MiB)" for n, f in meta["files"].items())
    print(f"optimizer {meta['optimizer']['type']}, {len(meta['optimizer']['param_groups'])} group(s); files: {sizes}")
    width = max((len(n) for n in meta["params"]), default=4)
    print(f"{'parameter':<{width}}  {'shape':<18} {'dtype':<9} {'trainable':<9} pieces")
    for name, entry in meta["params"].items():
        pieces = ", ".join(f"{p['file'].removesuffix('.safetensors')}[{p['start']}:{p['end']}]" for p in entry["pieces"])
        print(f"{name:<{width}}  {str(tuple(entry['shape'])):<18} {entry['dtype']:<9} {str(entry['trainable']):<9} {pieces}")


def _inspect_deepspeed(reader: Any) -> None:
    meta = reader.meta
    print(f"{reader.path}: DeepSpeed {meta['deepspeed_version']} checkpoint, world size {meta['world_size']}, ZeRO "
          f"stage {meta['stage']}, step {meta['counters']['global_steps']} (shardwise loads it as it is)")
    groups = meta["optimizer"].get("groups") or []
    print(f"optimizer {meta['optimizer']['deepspeed_type'] or 'a client optimizer'}, {len(groups)} group(s)")
    width = max((len(n) for n in meta["params"]), default=4)
    print(f"{'parameter':<{width}}  {'shape':<18} {'trainable':<9} kinds")
    for name, entry in meta["params"].items():
        print(f"{name:<{width}}  {str(tuple(entry['shape'])):<18} {str(entry['trainable']):<9} "
              f"{', '.join(sorted(reader.kinds(name)))}")


def to_fp32(args: argparse.Namespace) -> None:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    paths = consolidate(args.checkpoint, args.out, args.tag, parse_size(args.max_shard_size), dtype)
    print(f"wrote {len(paths)} file(s) to {args.out}: {', '.join(p.name for p in paths)}")


def export(args: argparse.Namespace) -> None:
    from .deepspeed_export import export_deepspeed

    written = export_deepspeed(args.checkpoint, args.out, args.world, args.stage, args.tag, args.out_tag,
                               args.sub_group_size)
    print(f"wrote DeepSpeed's layout (world size {args.world}, ZeRO stage {args.stage}) to {written}; "
          f"{written.parent / 'latest'} names it")


def import_(args: argparse.Namespace) -> None:
    from .deepspeed_import import import_deepspeed

    written = import_deepspeed(args.checkpoint, args.out, args.tag, args.out_tag)
    print(f"wrote a shardwise copy of {args.checkpoint} to {written}; {written.parent / 'latest'} names it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise checkpoint", description="Inspect or consolidate a checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print the manifest as a table")
    p.add_argument("checkpoint")
    p.add_argument("--tag")
    p.set_defaults(run=inspect)
    p = sub.add_parser("to-fp32", help="write full weights as safetensors (Hugging Face layout)")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--tag")
    p.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--bf16", action="store_true", help="write bf16 instead of fp32")
    p.set_defaults(run=to_fp32)
    p = sub.add_parser("export", help="write a checkpoint in DeepSpeed's layout, for DeepSpeed to resume")
    p.add_argument("--to", choices=["deepspeed"], required=True, help="the layout to write")
    p.add_argument("--world", type=int, required=True, help="data-parallel size DeepSpeed will resume at")
    p.add_argument("--stage", type=int, required=True, choices=[1, 2, 3], help="ZeRO stage DeepSpeed will resume at")
    p.add_argument("--tag", help="the source's tag (default: its latest)")
    p.add_argument("--out-tag", help="the tag folder to write (default: global_step<N>)")
    p.add_argument("--sub-group-size", type=int, default=1_000_000_000,
                   help="DeepSpeed's zero_optimization.sub_group_size, at stage 3 (default 1e9, its default)")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.set_defaults(run=export)
    p = sub.add_parser("import", help="copy a DeepSpeed checkpoint into shardwise's format (load_checkpoint reads "
                                      "DeepSpeed's folders directly; this is for a copy on disk)")
    p.add_argument("--tag", help="the source's tag (default: its latest)")
    p.add_argument("--out-tag", help="the tag folder to write (default: the source's)")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.set_defaults(run=import_)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except CheckpointError as e:
        print(f"shardwise checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
