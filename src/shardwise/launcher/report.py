"""``shardwise report``: versions, devices, and which optional pieces actually work here, as a table.

Every optional piece is *tried* (a one-step fused CPU Adam, a tiny flex-attention call, ...), not just
imported, so "yes" means it ran. ``--json`` prints the same as JSON. :func:`ds_report_main` is the same
report for the ``ds_report`` command of the compatibility distribution, with DeepSpeed's two flags.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import shutil
import sys
import warnings
from collections.abc import Callable


def _try(check: Callable[[], str]) -> str:
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - the report shows what failed and why
        return f"no ({type(error).__name__}: {str(error).splitlines()[0][:70] if str(error) else ''})"


def _versions() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    from shardwise.version import __version__

    cuda = torch.version.cuda or "none (CPU build)"
    nccl = _try(lambda: ".".join(map(str, torch.cuda.nccl.version()))) if torch.cuda.is_available() else "n/a (no CUDA)"
    return [
        ("shardwise", __version__), ("python", platform.python_version()), ("torch", torch.__version__),
        ("CUDA (torch built with)", cuda), ("NCCL", nccl),
        ("gloo backend", "yes" if dist.is_gloo_available() else "no"),
        ("NCCL backend", "yes" if dist.is_nccl_available() else "no"),
        ("MPI backend", "yes" if dist.is_mpi_available() else "no"),
    ]


def _devices() -> list[tuple[str, str]]:
    import os

    import torch

    rows = [("CPU cores", str(os.cpu_count()))]
    if not torch.cuda.is_available():
        return rows + [("CUDA devices", "none")]
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        rows.append((f"cuda:{index}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}"))
    return rows


def _cpu_adam() -> str:
    import torch

    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)
    torch.optim.AdamW([param], lr=0.1, fused=True).step()
    return "yes (torch fused AdamW on CPU)" if param.detach().lt(1).all() else "no (step did not update)"


def _flex_attention() -> str:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 16, 8)
    with warnings.catch_warnings():  # eager (uncompiled) use warns; a tiny call is all the check needs
        warnings.simplefilter("ignore")
        out = flex_attention(q, q, q)
    return "yes" if out.shape == q.shape else "no (wrong shape)"


def _async_io() -> str:
    module = importlib.util.find_spec("shardwise.offload")
    if module is None:
        return "no (shardwise.offload is not part of this build)"
    return "yes" if importlib.util.find_spec("shardwise.offload.nvme") else "no (no NVMe swapper)"


def _tools() -> list[tuple[str, str]]:
    return [(f"launcher: {tool}", shutil.which(tool) or "not found")
            for tool in ("ssh", "pdsh", "mpirun", "srun", "kubectl")]


def _pieces() -> list[tuple[str, str]]:
    return [("CPU Adam", _try(_cpu_adam)), ("flex attention", _try(_flex_attention)),
            ("async I/O (NVMe)", _try(_async_io))]


def collect(pieces: bool = True) -> list[tuple[str, str]]:
    return _versions() + _devices() + (_pieces() if pieces else []) + _tools()


def _print(rows: list[tuple[str, str]], as_json: bool) -> int:
    if as_json:
        print(json.dumps(dict(rows), indent=1))
        return 0
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: shardwise report [--json]\n\n" + (__doc__ or "").strip())
        return 0
    return _print(collect(), "--json" in argv)


def ds_report_main(argv: list[str] | None = None) -> int:
    """Entry point for a ``ds_report`` console script: DeepSpeed's flags, shardwise's report."""
    parser = argparse.ArgumentParser(prog="ds_report", description="Versions, devices and which optional pieces "
                                     "of shardwise (standing in for DeepSpeed) work on this machine.")
    parser.add_argument("--hide_operator_status", action="store_true",
                        help="leave out the optional pieces (CPU Adam, flex attention, async I/O), which are tried")
    parser.add_argument("--hide_errors_and_warnings", action="store_true",
                        help="say 'no' for a piece that does not work, without the error")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rows = collect(pieces=not args.hide_operator_status)
    if args.hide_errors_and_warnings:
        rows = [(name, "no" if value.startswith("no (") else value) for name, value in rows]
    return _print(rows, args.json)
