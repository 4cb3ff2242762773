"""Command lines of the multi-node runners (pure: builds argv lists, starts nothing).

* ``ssh`` — one ``ssh host '<node agent>'`` per node; ``pdsh`` — one ``pdsh -w hosts '<node agent>'``.
  Both start ``node.py`` on each node, which runs PyTorch's elastic agent there and holds the lifeline.
* ``openmpi`` / ``mpich`` / ``slurm`` — ``mpirun`` / ``srun`` start every rank themselves (through
  ``bootstrap.py``) and supervise them; ranks find their place from the scheduler's variables
  (``distributed/env.py``).

Only three kinds of text reach a remote shell: validated host names, the job spec as one base64 word, and
environment values, each passed through ``shlex.quote``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shardwise.launcher.jobspec import JobSpec

RUNNERS = ("ssh", "pdsh", "openmpi", "mpich", "slurm")
AGENT_MODULE = "shardwise.launcher.node"
BOOTSTRAP_MODULE = "shardwise.launcher.bootstrap"


class RunnerError(ValueError):
    """The chosen runner cannot run this job as asked; the message says why and what to use instead."""


@dataclass(frozen=True)
class Command:
    """One local process to start: ``argv`` with ``env`` added to ours; ``node`` when it serves one node."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    node: int | None = None


def _quoted_env(env: Mapping[str, str]) -> list[str]:
    words = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    if env.get("VIRTUAL_ENV"):  # the venv's bin first on PATH, the remote's own PATH after it
        words.append(f'PATH={shlex.quote(os.path.join(env["VIRTUAL_ENV"], "bin"))}:"$PATH"')
    return words


def remote_command(spec: JobSpec, python: str, cwd: str, env: Mapping[str, str], node_arg: str,
                   venv_script: str | None = None) -> str:
    """The shell line a node runs: cd, source ``--venv_script`` if any, set the carried env, exec the node agent."""
    source = [".", shlex.quote(venv_script), "&&"] if venv_script else []
    return " ".join([
        "cd", shlex.quote(cwd), "&&", *source, "exec", "env", *_quoted_env(env),
        shlex.quote(python), "-u", "-m", AGENT_MODULE, spec.encode(), shlex.quote(node_arg),
    ])


def ssh_commands(spec: JobSpec, python: str, cwd: str, env: Mapping[str, str], launcher_args: Sequence[str] = (),
                 ssh_port: int | None = None, venv_script: str | None = None) -> list[Command]:
    options = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-o", "ServerAliveInterval=10"]
    options += ["-p", str(ssh_port)] if ssh_port else []
    return [
        Command(["ssh", *options, *launcher_args, host,
                 remote_command(spec, python, cwd, env, f"--node_rank={rank}", venv_script)], node=rank)
        for rank, (host, _) in enumerate(spec.nodes)
    ]


def pdsh_commands(spec: JobSpec, python: str, cwd: str, env: Mapping[str, str], launcher_args: Sequence[str] = (),
                  ssh_port: int | None = None, venv_script: str | None = None) -> list[Command]:
    """pdsh replaces ``%h`` with each host's name as listed, so each agent finds its node rank by name."""
    hosts = [host for host, _ in spec.nodes]
    ssh_args = " ".join(["-o BatchMode=yes", *([f"-p {ssh_port}"] if ssh_port else []),
                         os.environ.get("PDSH_SSH_ARGS_APPEND", "")]).strip()
    argv = ["pdsh", "-S", "-f", str(len(hosts)), "-w", ",".join(hosts), *launcher_args,
            remote_command(spec, python, cwd, env, "--host=%h", venv_script)]
    return [Command(argv, env={"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": ssh_args})]


def rank_command(spec: JobSpec, python: str) -> list[str]:
    """What mpirun/srun start for every rank: the bootstrap, then the script."""
    head = ["--pass-local-rank"] if spec.pass_local_rank else []
    return [python, "-u", "-m", BOOTSTRAP_MODULE, *head, spec.mode, spec.script, *spec.script_args]


def _uniform_nproc(spec: JobSpec, runner: str) -> int:
    counts = {len(slots) for _, slots in spec.nodes}
    if len(counts) != 1:
        raise RunnerError(f"--launcher {runner} starts the same number of processes on every node; got "
                          f"{', '.join(f'{h}: {len(s)}' for h, s in spec.nodes)}. Use --num_gpus, or --launcher ssh.")
    return counts.pop()


def _no_slot_choice(spec: JobSpec, runner: str) -> None:
    for host, slots in spec.nodes:
        if slots != tuple(range(len(slots))):
            raise RunnerError(f"--launcher {runner} cannot use particular slots ({host}: {list(slots)}); "
                              "--include/--exclude of slots need --launcher ssh or pdsh.")


def scheduler_env(spec: JobSpec, env: Mapping[str, str]) -> dict[str, str]:
    return {**env, "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port)}


def openmpi_commands(spec: JobSpec, python: str, env: Mapping[str, str], hostfile: str,
                     launcher_args: Sequence[str] = (), as_root: bool = False, ssh_port: int | None = None) -> list[Command]:
    """``hostfile`` is written by the caller in Open MPI's format (``openmpi_hostfile``); Open MPI reaches the
    nodes with ssh, whose port goes in its ``plm_rsh_args``."""
    _no_slot_choice(spec, "openmpi")
    exports = [w for k, v in sorted(scheduler_env(spec, env).items()) for w in ("-x", f"{k}={v}")]
    port = ["--mca", "plm_rsh_args", f"-p {ssh_port}"] if ssh_port else []
    argv = ["mpirun", "-n", str(spec.world_size), "--hostfile", hostfile, "--mca", "btl", "^openib", *port,
            *(["--allow-run-as-root"] if as_root else []), *exports, *launcher_args, *rank_command(spec, python)]
    return [Command(argv)]


def openmpi_hostfile(spec: JobSpec) -> str:
    return "".join(f"{host} slots={len(slots)}\n" for host, slots in spec.nodes)


def mpich_commands(spec: JobSpec, python: str, env: Mapping[str, str], launcher_args: Sequence[str] = ()) -> list[Command]:
    _no_slot_choice(spec, "mpich")
    per_node = _uniform_nproc(spec, "mpich")
    exports = [w for k, v in sorted(scheduler_env(spec, env).items()) for w in ("-genv", k, v)]
    argv = ["mpirun", "-n", str(spec.world_size), "-ppn", str(per_node), "-hosts", ",".join(h for h, _ in spec.nodes),
            *exports, *launcher_args, *rank_command(spec, python)]
    return [Command(argv)]


def slurm_commands(spec: JobSpec, python: str, env: Mapping[str, str], launcher_args: Sequence[str] = (),
                   comment: str = "", account: str = "") -> list[Command]:
    """srun passes our environment on (its default ``--export=ALL``), so the carried env goes in ``env``."""
    _no_slot_choice(spec, "slurm")
    per_node = _uniform_nproc(spec, "slurm")
    tags = ([f"--comment={comment}"] if comment else []) + ([f"--account={account}"] if account else [])
    argv = ["srun", "-n", str(spec.world_size), f"--ntasks-per-node={per_node}",
            f"--nodelist={','.join(h for h, _ in spec.nodes)}", "--kill-on-bad-exit=1", *tags, *launcher_args,
            *rank_command(spec, python)]
    return [Command(argv, env=scheduler_env(spec, env))]
