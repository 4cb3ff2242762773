"""Run a script of tests/compat/scripts the way users launch it, under shardwise's compatibility package or
the real DeepSpeed, and return the `RESULT` it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwise.distributed.env import free_port
from tests.compat.zygote import Zygote
from tests.rank_zygote import HF_PRELOAD, routing

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
    on failure. "torchrun" means torchrun's environment for each rank: those runs fork from a pre-imported
    interpreter (zygote.py), which saves each rank its ~8 s of imports; the launchers themselves are what the
    "deepspeed" and "accelerate" runs (and tests/distributed's launcher tests) start for real."""
    script = str(SCRIPTS / name)
    port = str(free_port())
    full_env = {**_script_env(python), **(env or {})}
    if launcher == "torchrun" and _zygote_serves(python, full_env):
        return _forked(python, script, list(args), world, full_env, port, timeout)
    if world == 1 and launcher == "torchrun":
        full_env.update(_rank_env(0, 1, port))
        command = [python, script, *args]
    elif launcher == "accelerate":  # `accelerate launch --use_deepspeed`; on CPU accelerate gives DeepSpeed one process
        full_env.update(ACCELERATE_USE_CPU="false")
        # with --config_file its distributed_type decides: accelerate reads the file's parallelism_config only
        # when no --use_* flag is given
        paradigm = [] if "--config_file" in (accelerate_args or []) else ["--use_deepspeed"]
        command = [python, "-m", "accelerate.commands.launch", *paradigm, "--num_processes", str(world),
                   "--main_process_port", port, *(accelerate_args or []), script, *args]
    elif launcher == "torchrun":
        command = [python, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={port}",
                   script, *args]
    else:
        command = [str(Path(python).parent / "deepspeed"), f"--num_gpus={world}", f"--master_port={port}", script, *args]
        if python == sys.executable:  # shardwise's launcher: its ranks fork from a pre-imported interpreter
            full_env.update(routing(HF_PRELOAD))
    done = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return _result(python, command, done.returncode, done.stdout, done.stderr)


def _result(python: str, command: list[str], code: int, stdout: str, stderr: str) -> dict:
    output = stdout + stderr
    results = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
    if (code != 0 and not _reference_teardown_abort(python, output)) or not results:
        raise AssertionError(f"{' '.join(command)} exited {code}:\n{output[-6000:]}")
    return json.loads(results[0])


def _script_env(python: str) -> dict[str, str]:
    """Every script's environment before a run's own additions (the zygote starts with it too)."""
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": _pythonpath(python)}


def _rank_env(rank: int, world: int, port: str) -> dict[str, str]:
    """What torchrun gives each rank (its agent's store aside: rank 0 hosts the rendezvous)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port}


_ZYGOTES: dict[str, Zygote] = {}


def _zygote_serves(python: str, env: dict[str, str]) -> bool:
    """torchrun-style runs fork from a pre-imported interpreter (zygote.py) unless SHARDWISE_TEST_ZYGOTE=0, or
    a run asks for another PYTHONPATH than the zygote was started with."""
    return os.environ.get("SHARDWISE_TEST_ZYGOTE", "1") != "0" and env["PYTHONPATH"] == _pythonpath(python)


def _forked(python: str, script: str, args: list[str], world: int, env: dict[str, str], port: str,
            timeout: float) -> dict:
    zygote = _ZYGOTES.get(python)
    if zygote is None or not zygote.alive():
        zygote = _ZYGOTES[python] = Zygote(python, _script_env(python), str(ROOT))
    command = [f"(zygote of {python}, torchrun environment x{world})", script, *args]
    with tempfile.TemporaryDirectory(prefix="zygote-") as logs:
        outputs = [(os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err")) for r in range(world)]
        envs = [{**env, **_rank_env(r, world, port)} for r in range(world)]
        codes = zygote.run(script, args, str(ROOT), envs, outputs, timeout)
        texts = [[Path(path).read_text(errors="replace") for path in pair] for pair in outputs]
    code = next((c for c in codes if c != 0), 0)
    return _result(python, command, code, "".join(out for out, _ in texts), "".join(err for _, err in texts))


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
