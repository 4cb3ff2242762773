"""The children of benchmarks/gpu_train.py: one process per configuration, started with the import path its
library needs, watched under a deadline and a host-memory floor.

[Note: one process per configuration] A fresh process gives each configuration its own CUDA context, caching
allocator and peak (`torch.cuda.max_memory_allocated`), and keeps shardwise and DeepSpeed apart: a shardwise
child imports this tree's `src/`, a DeepSpeed child the real DeepSpeed's site, placed first on PYTHONPATH so that
it shadows the compat package `make gpu-install` puts into site-packages under the same name. A child imports
its libraries, then waits for a line on stdin before it touches the device, so the next configuration's imports
(seconds of CPU) overlap the current one's GPU work instead of adding to the wall time (`overlap` in the report).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from shardwise.distributed.env import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHILD = HERE / "_gpu_train_child.py"
POLL_SECONDS = 0.2
DUMP_SECONDS = 2.0
TAIL_CHARS = 3000


def log(message: str) -> None:
    print(f"[gpu_train {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields[key].split()[0]) * 1024


Guard = Callable[[int], "str | None"]
"""Called with a running child's pid every poll: a reason to kill it now, or None."""


def host_floor_guard(floor_bytes: int) -> Guard:
    """Kills the child before the host runs dry: an OOM-killer's pick (or a pinned allocation that stalls the
    whole machine) could take the parent, or the device tool's own processes, instead of the child."""
    def guard(pid: int) -> str | None:
        available = meminfo_bytes("MemAvailable")
        if available < floor_bytes:
            return f"the host's available memory fell to {available / 2**30:.1f} GiB " \
                   f"(floor {floor_bytes / 2**30:.1f} GiB)"
        return None
    return guard


def clear_build_locks(since: float, keep: set[str]) -> list[str]:
    """Removes the `lock` files that torch's JIT extension builds left after `since`, except in the op
    folders named in `keep` (a build still running). A build holds its folder's `lock` while it compiles; a
    process killed meanwhile leaves it behind, and every later load of that op waits on it for ever."""
    roots = [Path(os.environ["TORCH_EXTENSIONS_DIR"])] if os.environ.get("TORCH_EXTENSIONS_DIR") else \
        list((Path.home() / ".cache" / "torch_extensions").glob("*"))
    removed = []
    for lock in (p for root in roots for p in root.glob("*/lock")):
        if lock.parent.name not in keep and lock.stat().st_mtime >= since:
            lock.unlink(missing_ok=True)
            removed.append(str(lock))
    return removed


class Child:
    """One configuration's process: started at once (it imports, then waits), run by `go`, read by `wait`."""

    on_kill: Callable[[Child], None] = staticmethod(lambda child: None)

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path):
        self.name, self.started = name, time.time()
        self.stdout_path, self.stderr_path = logs / f"{name}.out", logs / f"{name}.err"
        # Files, not pipes: DeepSpeed logs to stdout, and a pipe nobody reads would block it when full.
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                         start_new_session=True)  # its own group: a kill takes its compilers too

    def go(self) -> None:
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        except BrokenPipeError:  # it died while importing: `wait` reports its stderr
            pass

    def dump_stacks(self) -> str | None:
        """Every thread's Python stack in a hung child (its faulthandler writes them to its stderr; what came
        after the ask, stacks first): on the device a hang is diagnosed from these, not rerun."""
        offset = self.stderr_path.stat().st_size
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
            self.proc.wait(timeout=DUMP_SECONDS)  # returns early only if the signal ended it (no handler yet)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        with open(self.stderr_path, "rb") as f:
            f.seek(offset)
            return f.read(2 * TAIL_CHARS).decode(errors="replace") or None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.on_kill(self)
        self.proc.wait()

    def wait(self, timeout: float, guards: tuple[Guard, ...] = ()) -> dict[str, Any]:
        started = time.monotonic()
        while self.proc.poll() is None:
            reason = "timeout" if time.monotonic() - started > timeout else None
            reason = reason or next((r for r in (g(self.proc.pid) for g in guards) if r), None)
            if reason:
                stacks = self.dump_stacks() if reason == "timeout" else None
                self.kill()
                status = "timeout" if reason == "timeout" else "killed"
                return {"config": self.name, "status": status, "reason": reason if status == "killed" else
                        f"still running after {timeout:.0f}s", "seconds": round(time.monotonic() - started, 1),
                        "stderr_tail": self.tail(), **({"stacks_at_timeout": stacks} if stacks else {})}
            time.sleep(POLL_SECONDS)
        return self._result(round(time.monotonic() - started, 1))

    def _result(self, seconds: float) -> dict[str, Any]:
        lines = self.stdout_path.read_text(errors="replace").splitlines()
        result = next((json.loads(line[7:]) for line in reversed(lines) if line.startswith("RESULT ")), None)
        if self.proc.returncode or result is None:
            return {"config": self.name, "status": "failed", "returncode": self.proc.returncode,
                    "seconds": seconds, "stderr_tail": self.tail()}
        return {**result, "status": "ok", "seconds": seconds}

    def tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-TAIL_CHARS:]


class Children:
    """Builds each child's command line and environment; knows where the real DeepSpeed is."""

    def __init__(self, deepspeed_site: str | None, deepspeed_python: str | None, logs: Path):
        self.deepspeed_site, self.deepspeed_python = deepspeed_site, deepspeed_python
        self.logs = logs
        self.op_build: Child | None = None
        """The child building DeepSpeed's CPU Adam op, while it runs: its lock is live."""
        logs.mkdir(parents=True, exist_ok=True)

    def _after_kill(self, child: Child) -> None:
        """A DeepSpeed child killed mid-build would leave its op's lock: clear it, not the live build's."""
        building = self.op_build is not None and self.op_build is not child and self.op_build.proc.poll() is None
        removed = clear_build_locks(child.started, {"cpu_adam"} if building else set())
        if removed:
            log(f"{child.name} was killed mid-build: removed {', '.join(removed)}")

    @property
    def has_deepspeed(self) -> bool:
        return bool(self.deepspeed_site or self.deepspeed_python)

    def start(self, config: str, spec: dict[str, Any]) -> Child | dict[str, Any]:
        """The started child, or a `skipped` record when its library is not here."""
        deepspeed = config.startswith("deepspeed")
        if deepspeed and not self.has_deepspeed:
            return {"config": config, "status": "skipped", "reason": "DeepSpeed is not available: no .whl/peer/ "
                    "wheels, --deepspeed-site or --deepspeed-python"}
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if deepspeed:
            paths = self.deepspeed_site.split(os.pathsep) if self.deepspeed_site else []
            if spec["device"] == "cpu":
                env["DS_ACCELERATOR"] = "cpu"
        else:
            paths = [str(REPO / "src")]  # this tree's shardwise, whatever else is installed
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(HERE)])
        python = (self.deepspeed_python if deepspeed else None) or sys.executable
        spec = {**spec, "config": config, "port": free_port()}
        child = Child(config, [python, str(CHILD), json.dumps(spec)], env, self.logs)
        if deepspeed:
            child.on_kill = self._after_kill
        return child

    def run(self, config: str, spec: dict[str, Any], timeout: float, guards: tuple[Guard, ...] = ()
            ) -> dict[str, Any]:
        """Start, run and wait for one child, nothing overlapping it."""
        child = self.start(config, spec)
        if isinstance(child, dict):
            return child
        child.go()
        return child.wait(timeout, guards)


class OpBuild:
    """DeepSpeed's CPU Adam op compiled in a process of its own from the start of the run (a C++ build of half
    a minute or more), so that the offloaded DeepSpeed config loads it built and its compile is timed apart. It
    runs beside the GPU configs, whose steps the device bounds, not the CPU."""

    def __init__(self, children: Children, spec: dict[str, Any], wanted: bool):
        self.child: Child | None = None
        self.result: dict[str, Any] | None = None
        if wanted and children.has_deepspeed:
            started = children.start("deepspeed-op-build", spec)
            if isinstance(started, Child):
                started.go()
                self.child = children.op_build = started

    def wait(self, deadline: float) -> None:
        if self.child and self.result is None:
            self.result = self.child.wait(max(deadline - time.monotonic(), 1.0))
            log(f"DeepSpeed's CPU Adam op: {describe(self.result)}, built or loaded in "
                f"{self.result.get('op_build_seconds')}s")

    def close(self) -> dict[str, Any] | None:
        if self.child and self.result is None:
            self.child.kill()
            self.result = {"status": "not needed: no offloaded DeepSpeed config ran"}
        return self.result


def deepspeed_site(explicit: str | None, python: str | None, target: Path) -> str | None:
    """Where the real DeepSpeed imports from: `explicit` (os.pathsep-separated folders), else .whl/peer/'s
    wheels unpacked once into `target` (the device kit's way: the image has no DeepSpeed, and the compat package
    must not be replaced in site-packages, so the wheels go to a folder of their own)."""
    if explicit:
        return explicit
    wheels = sorted((REPO / ".whl" / "peer").glob("*.whl"))
    if not wheels or python:
        return None
    if not (target / "deepspeed" / "__init__.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                        "--no-deps", "--no-compile", "--target", str(target), *map(str, wheels)], check=True)
    return str(target)


def run_in_turn(children: Children, configs: list[str], spec_of: Callable[[str], dict[str, Any]],
                timeout_of: Callable[[str], float], deadline: float, overlap: bool,
                before: Callable[[str], None] = lambda c: None, guards: tuple[Guard, ...] = ()
                ) -> list[dict[str, Any]]:
    """Each config in its own child, one on the device at a time; with `overlap` the next child is started
    (and imports) while the current one runs, unless the current one is offloaded (its optimizer step is the
    host's). A config left without `MIN_LEFT` seconds is skipped."""
    results: list[dict[str, Any]] = []
    waiting: Child | dict[str, Any] | None = None
    for i, config in enumerate(configs):
        if waiting is None and deadline - time.monotonic() < MIN_LEFT:
            child: Child | dict[str, Any] = {"config": config, "status": "skipped", "reason": BUDGET_SPENT}
        else:
            child = waiting if waiting is not None else children.start(config, spec_of(config))
        waiting = None
        following = configs[i + 1] if i + 1 < len(configs) else None
        if isinstance(child, Child):
            before(config)  # may wait (DeepSpeed's op build): the time left is read after it
            if deadline - time.monotonic() < MIN_LEFT:
                child.kill()
                child = {"config": config, "status": "skipped", "reason": BUDGET_SPENT}
        if isinstance(child, dict):
            results.append(child)
            log(f"{config}: {child['status']} ({child['reason']})")
            continue
        child.go()
        # An offloaded config steps on the host's cores: nothing may import beside it.
        if overlap and following and "offload" not in config:
            waiting = children.start(following, spec_of(following))
        results.append(child.wait(min(timeout_of(config), deadline - time.monotonic()), guards))
        log(f"{config}: {describe(results[-1])}")
    return results


MIN_LEFT = 15.0
"""Seconds below which a config is not started: the shortest GPU config needs about this much."""
BUDGET_SPENT = "the run's --budget is spent"


def describe(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        last = [line for line in result.get("stderr_tail", "").splitlines() if line.strip()][-1:]
        return f"{result['status']}: {result.get('reason') or (last[0] if last else 'no stderr')}"
    if "step_seconds" not in result:
        return f"ok in {result['seconds']}s"
    steps, losses = result["step_seconds"], result["losses"]
    return (f"ok in {result['seconds']}s, step {min(steps):.3f}-{max(steps):.3f}s, loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}, peak {result['peak_memory_bytes'] / 2**30:.2f} GiB, {result.get('optimizer')}")
