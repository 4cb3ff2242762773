#!/usr/bin/env python3
"""The device suite's result as JSON (`make test-gpu` writes it beside the JUnit XML): the machine, the versions,
the commit, and each test's outcome and duration, so that benchmarks/results/gpu/ keeps what ran where.

    python3 tools/gpu_report.py JUNIT_XML [--out FILE] [--status PYTEST_EXIT_STATUS]
    python3 tools/gpu_report.py --env        # the machine, versions and commit alone (make test-gpu's first line)

The commit is `git rev-parse HEAD` where the tree has its .git, else $SHARDWISE_COMMIT, else .whl/commit.txt (the
device machine gets the working tree without .git; tools/fetch_device_wheels.sh stamps that file here, and the
device call carries it in .whl)."""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _gpu_train_report import commit  # noqa: E402 - one answer to "which commit ran", for the suite and the benchmark


def driver() -> str | None:
    """The NVIDIA driver's version (torch does not say it), or None without nvidia-smi."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(nccl=".".join(map(str, torch.cuda.nccl.version())), driver=driver(),
                   device_memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
    for name in ("shardwise", "deepspeed", "transformers", "peft", "accelerate", "pydantic"):
        try:
            from importlib.metadata import version

            env[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed is an answer too
            env[name] = None
    return env


def outcomes(junit: Path) -> list[dict[str, Any]]:
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(kinds[0] if kinds else "", "passed")
        entry = {"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                 "seconds": round(float(case.get("time") or 0), 2)}
        if kinds:
            entry["message"] = (case.find(kinds[0]).get("message") or "")[:500]
        cases.append(entry)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, nargs="?")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--status", type=int, help="pytest's exit status (124: interrupted at make's GPU_TIMEOUT; 137: killed 30 s later)")
    parser.add_argument("--env", action="store_true", help="print the machine, versions and commit, and stop")
    args = parser.parse_args()
    if args.env or args.junit is None:
        print("test-gpu environment:", json.dumps({**commit(), **environment()}), flush=True)
        return
    cases = outcomes(args.junit) if args.junit.exists() else []
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    report = {"suite": "make test-gpu", **commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), **environment(), "counts": counts, "seconds": round(sum(c["seconds"] for c in cases), 1),
              "pytest_status": args.status, "timed_out": args.status in (124, 137),
              "junit_found": args.junit.exists(),
              "tests": cases}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({k: report[k] for k in ("commit", "device", "torch", "counts", "seconds", "timed_out")}))


if __name__ == "__main__":
    main()
