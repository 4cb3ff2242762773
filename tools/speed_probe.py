"""How fast this machine is right now, for reading a CI run's times against earlier runs' (`.ci/run` prints it).

VMs of one kind have run the same tree's tests ~1.8x apart from one day to the next (stop 51's tree, 0b5d50a: 690 s
for its whole CI run, 786 s for `make test` alone on 2026-11-29). Two figures that track what the tests spend their
time on: starting an interpreter that imports torch, and single-threaded fp32 matrix products. On the session VM on
2026-11-29 (the slow day above), idle: 1.7-2.5 s and 0.35-0.42 s."""

from __future__ import annotations

import subprocess
import sys
import time


def main() -> None:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    imported = time.perf_counter() - start
    import torch

    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    a @ a
    start = time.perf_counter()
    for _ in range(200):
        a @ a
    products = time.perf_counter() - start
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"ci: speed probe: python -c 'import torch' {imported:.2f} s, 200 fp32 512x512 products on one thread "
          f"{products:.2f} s, load average {load}")


if __name__ == "__main__":
    main()
