"""Run a script of tests/compat/scripts the way users launch it, under shardwise's compatibility package or
the real DeepSpeed, and return the `RESULT` it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from shardwise.distributed.env import free_port

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parents[2]


def deepspeed_python() -> str | None:
    """The interpreter that has the real DeepSpeed (`make test-deepspeed` sets it), else None."""
    return os.environ.get("SHARDWISE_DEEPSPEED_PYTHON") or None


def run_script(name: str, *args: str, world: int = 1, python: str = sys.executable, launcher: str = "torchrun",
               timeout: float = 300, env: dict[str, str] | None = None,
               accelerate_args: list[str] | None = None) -> dict:
    """`python scripts/<name> args` on `world` processes; `launcher` is "torchrun", "deepspeed" (the
    `deepspeed` command next to `python`) or "accelerate". Returns rank 0's RESULT; raises with the output
    on failure."""
    script = str(SCRIPTS / name)
    port = str(free_port())
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath(python),
                **(env or {})}
    if world == 1 and launcher == "torchrun":
        full_env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port)
        command = [python, script, *args]
    elif launcher == "accelerate":  # `accelerate launch --use_deepspeed`; on CPU accelerate gives DeepSpeed one process
        full_env.update(ACCELERATE_USE_CPU="false")
        command = [python, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", str(world),
                   "--main_process_port", port, *(accelerate_args or []), script, *args]
    elif launcher == "torchrun":
        command = [python, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={port}",
                   script, *args]
    else:
        command = [str(Path(python).parent / "deepspeed"), f"--num_gpus={world}", f"--master_port={port}", script, *args]
    done = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    output = done.stdout + done.stderr
    results = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if (done.returncode != 0 and not _reference_teardown_abort(python, output)) or not results:
        raise AssertionError(f"{' '.join(command)} exited {done.returncode}:\n{output[-6000:]}")
    return json.loads(results[0])


def _reference_teardown_abort(python: str, output: str) -> bool:
    """The real DeepSpeed's process aborting at exit, after the script reported and every rank finished training:
    a C++ thread destroyed unjoined at interpreter shutdown ("terminate called without an active exception"),
    seen under load in its shared-memory comm op. The results it printed are the reference's; shardwise's own runs
    get no such pass."""
    return python != sys.executable and "terminate called without an active exception" in output


def _pythonpath(python: str) -> str:
    """shardwise's source for our own venv; for DeepSpeed's venv, only the repository (for tests/compat)."""
    own = [str(ROOT / "src")] if python == sys.executable else []
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if python != sys.executable:  # our `deepspeed` package must never stand in for the real one it is compared with
        inherited = [p for p in inherited if Path(p).resolve() != (ROOT / "compat" / "deepspeed").resolve()]
    return os.pathsep.join([*own, str(ROOT), *inherited])
