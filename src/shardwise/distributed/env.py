"""Where rank, world size and master address come from (stdlib only).

Sources, first match wins:

1. ``RANK``/``WORLD_SIZE`` (+ ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): shardwise's launcher,
   ``torchrun``, and Kubeflow PyTorchJob pods (the operator sets ``RANK`` = pod index and ``WORLD_SIZE`` =
   pods × ``nprocPerNode``; with ``nprocPerNode`` > 1 the pod must run ``shardwise``/``torchrun``, which read
   the ``PET_*`` variables — see :func:`_check_pytorchjob`; operators older than ``nprocPerNode`` set no
   ``PET_*``, and ``WORLD_SIZE`` counts pods of one process each);
2. Open MPI (``OMPI_COMM_WORLD_*``), MPICH/Intel MPI Hydra (``PMI_RANK``/``PMI_SIZE``, ``MPI_LOCALRANKID``),
   PMIx (``PMIX_RANK``): master from ``MASTER_ADDR``, or this host when every rank is local;
3. SLURM ``srun`` tasks (``SLURM_PROCID``/``SLURM_NTASKS`` with a ``SLURM_STEP_ID``; not the batch script
   itself): master from ``MASTER_ADDR`` or the first host of ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``;
4. Kubeflow Trainer v2 TrainJob pods, whose torch runtime sets only torchrun's ``PET_NNODES``,
   ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``/``PET_MASTER_PORT``: with one process per
   node the pod's index is the rank; with more, plain ``python`` cannot know its rank and is refused (the
   ``shardwise`` launcher reads the same variables through :func:`pod_of_job` and starts them all);
5. nothing: a plain ``python train.py`` is world size 1 on a free local port, so the same script runs
   unchanged under every launcher.

Inconsistent variables are an error that names them, never a hang.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass


class EnvError(ValueError):
    """The launcher's variables are missing or disagree; the message names them and says how to start."""


HOW_TO_START = "Start the script with `shardwise`, `torchrun`, `mpirun`, `srun` or plain `python`."


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str = "env"  # which launcher's variables these came from (for messages)

    def export(self) -> None:
        """Write the variables torch.distributed's env:// rendezvous reads."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise EnvError(f"environment variable {name} is not set. {HOW_TO_START}")
        return default
    try:
        return int(value)
    except ValueError:
        raise EnvError(f"environment variable {name}: must be an integer; got {value!r}.") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    return next((_int(env, n) for n in names if env.get(n)), default)


def _from_torch(env: Mapping[str, str], default_port: int) -> DistEnv:
    _check_pytorchjob(env)
    source = "kubeflow" if "PET_NNODES" in env and "TORCHELASTIC_RUN_ID" not in env else "torch"
    # LOCAL_SIZE: DeepSpeed's own launcher's name for it
    return DistEnv(_int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK", 0),
                   _first_int(env, ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"), 1), env.get("MASTER_ADDR", "127.0.0.1"),
                   _int(env, "MASTER_PORT", default_port), source)


def _check_pytorchjob(env: Mapping[str, str]) -> None:
    """A PyTorchJob pod with nprocPerNode > 1 has RANK = pod index, WORLD_SIZE = all processes: not one rank's."""
    nproc = env.get("PET_NPROC_PER_NODE", "")
    if nproc.isdigit() and int(nproc) > 1 and "LOCAL_RANK" not in env and "TORCHELASTIC_RUN_ID" not in env:
        raise EnvError(
            f"this looks like a Kubeflow PyTorchJob pod with nprocPerNode={nproc} (PET_NPROC_PER_NODE) started "
            f"as plain `python`: RANK={env.get('RANK')} is the pod's index, not a process rank. Start the pod's "
            "command with `shardwise script.py ...` (or torchrun), which starts one process per device."
        )


@dataclass(frozen=True)
class PodOfJob:
    """One pod (node) of a Kubeflow job, as its operator describes it to the pod."""

    nnodes: int
    node_rank: int
    nproc: int | None  # processes per pod the job asks for; None where it leaves the count to the launcher
    master_addr: str
    master_port: int
    variables: str  # where these came from, for messages


POD_VARS = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
_OLD_OPERATOR_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Set for the processes a launcher started (torchrun, shardwise); a Kubeflow operator sets none of them on a pod.
_LAUNCHED_PROCESS_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def pod_of_job(environ: Mapping[str, str] | None = None) -> PodOfJob | None:
    """This pod's place in a Kubeflow job, for a launcher started as the pod's command; None outside one.

    PyTorchJob (Training Operator v1) and TrainJob (Trainer v2) pods carry torchrun's ``PET_*`` variables;
    PyTorchJobs of operators older than ``nprocPerNode`` carry only ``RANK`` (the pod's index), ``WORLD_SIZE``
    (the pods) and ``MASTER_ADDR``/``MASTER_PORT``, one process per pod."""
    env = os.environ if environ is None else environ
    if _has_pet(env):
        return _pet_pod(env)
    if all(env.get(v) for v in _OLD_OPERATOR_VARS) and not any(v in env for v in _LAUNCHED_PROCESS_VARS):
        pods, index = _int(env, "WORLD_SIZE"), _int(env, "RANK")
        if not 0 <= index < pods:
            raise EnvError(f"RANK ({index}) must be in [0, WORLD_SIZE ({pods})) (Kubeflow PyTorchJob variables); "
                           f"the operator's variables disagree. {HOW_TO_START}")
        return PodOfJob(pods, index, 1, env["MASTER_ADDR"], _int(env, "MASTER_PORT"),
                        "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, no PET_*")
    return None


def _has_pet(env: Mapping[str, str]) -> bool:
    return any(env.get(v) for v in (*POD_VARS, "PET_NPROC_PER_NODE"))


def _pet_pod(env: Mapping[str, str]) -> PodOfJob:
    missing = [v for v in POD_VARS if not env.get(v)]
    nnodes = env.get("PET_NNODES", "")
    if missing or not nnodes.isdigit():
        elastic = " (an elastic job: PET_NNODES is min:max)" if ":" in nnodes else ""
        have = ", ".join(f"{v}={env[v]}" for v in (*POD_VARS, "PET_NPROC_PER_NODE") if env.get(v))
        raise EnvError(f"this looks like a Kubeflow pod ({have}){elastic}, but "
                       f"{', '.join(missing) or 'PET_NNODES'} {'is' if len(missing) < 2 else 'are'} not set as a "
                       "fixed-size PyTorchJob or TrainJob sets them, so the pod's place in the job is unknown. Run a "
                       "fixed-size job (no elasticPolicy), or start the pod's command with torchrun.")
    nproc = env.get("PET_NPROC_PER_NODE", "")
    pods, index = int(nnodes), _int(env, "PET_NODE_RANK")
    if not 0 <= index < pods:
        raise EnvError(f"PET_NODE_RANK ({index}) must be in [0, PET_NNODES ({pods})); the operator's variables "
                       f"disagree. {HOW_TO_START}")
    return PodOfJob(pods, index, int(nproc) if nproc.isdigit() else None, env["PET_MASTER_ADDR"],
                    _int(env, "PET_MASTER_PORT"), f"PET_NNODES={pods}, PET_NPROC_PER_NODE={nproc or '(not set)'}")


def _from_kubeflow_pod(env: Mapping[str, str]) -> DistEnv | None:
    """A plain ``python`` process that is a TrainJob pod's command: the pod's index is the rank when the job
    asks one process per pod (or is one pod); otherwise nothing here knows this process's rank."""
    if not _has_pet(env):
        return None
    pod = _pet_pod(env)
    if pod.nproc == 1 or pod.nnodes == 1 and pod.nproc is None:
        return DistEnv(pod.node_rank, pod.nnodes, 0, 1, pod.master_addr, pod.master_port, "kubeflow")
    raise EnvError(
        f"this looks like a Kubeflow TrainJob pod ({pod.variables}, PET_NODE_RANK={pod.node_rank}) started as plain "
        "`python`: the job does not ask for one process per pod, so this process's rank among the job's is unknown "
        "and it would train alone. Start the pod's command with `shardwise script.py ...` (or torchrun), which "
        "starts one process per device, or set the job's numProcPerNode to 1."
    )


def _from_mpi(env: Mapping[str, str], default_port: int) -> DistEnv | None:
    if "OMPI_COMM_WORLD_RANK" in env:
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
        source = "openmpi"
    elif "PMI_RANK" in env:
        names, source = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), "mpich"
    elif "PMIX_RANK" in env and "PMIX_SIZE" in env:
        names, source = ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"), "pmix"
    else:
        return None
    rank, world = _int(env, names[0]), _int(env, names[1])
    local_rank, local_world = _int(env, names[2], rank), _int(env, names[3], world)
    master = env.get("MASTER_ADDR") or _local_master(local_world, world, source, "MASTER_ADDR")
    return DistEnv(rank, world, local_rank, local_world, master, _int(env, "MASTER_PORT", default_port), source)


def _local_master(local_world: int, world: int, source: str, var: str) -> str:
    if local_world == world:
        return "127.0.0.1"  # every rank is on this host
    raise EnvError(
        f"{source}: {world} ranks on several hosts, but {var} is not set, so rank 0's address is unknown. "
        f"Pass it to every rank (e.g. mpirun -x MASTER_ADDR=<first host>), or launch with "
        f"`shardwise --launcher {source if source != 'pmix' else 'openmpi'}`, which does."
    )


def _from_slurm(env: Mapping[str, str], default_port: int) -> DistEnv | None:
    if "SLURM_PROCID" not in env or not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        return None  # not an srun task (the batch script itself also has SLURM_PROCID=0)
    rank = _int(env, "SLURM_PROCID")
    world = _first_int(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), 1)
    per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
    node = _int(env, "SLURM_NODEID", 0)
    local_world = per_node[node] if node < len(per_node) else len(env.get("SLURM_GTIDS", "0").split(","))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    master = env.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else "127.0.0.1")
    return DistEnv(rank, world, _int(env, "SLURM_LOCALID", 0), local_world, master,
                   _int(env, "MASTER_PORT", default_port), "slurm")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``"gpu[03-05,9],cpu1"`` → ``"gpu03"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise EnvError(f"SLURM node list {nodelist!r}: cannot read its first host; set MASTER_ADDR.")
    prefix, ranges = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's ``"2(x3),1"`` → ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise EnvError(f"SLURM tasks per node {text!r}: cannot read {part!r}.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _check(env: DistEnv) -> DistEnv:
    if not 0 <= env.rank < env.world_size:
        raise EnvError(
            f"RANK ({env.rank}) must be in [0, WORLD_SIZE ({env.world_size})) ({env.source} variables); "
            f"the launcher's variables disagree. {HOW_TO_START}"
        )
    if not 0 <= env.local_rank < max(env.local_world_size, 1) or env.local_world_size > env.world_size:
        raise EnvError(
            f"LOCAL_RANK ({env.local_rank}) / LOCAL_WORLD_SIZE ({env.local_world_size}) do not fit WORLD_SIZE "
            f"({env.world_size}) ({env.source} variables). {HOW_TO_START}"
        )
    return env


def discover(default_port: int = 29500, environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables; without any, a single process on a free port."""
    found = launched(default_port, environ)
    return found if found is not None else DistEnv(0, 1, 0, 1, "127.0.0.1", free_port(), "none")


def launched(default_port: int = 29500, environ: Mapping[str, str] | None = None) -> DistEnv | None:
    """The launcher's variables, checked; None where no launcher's are set (a plain ``python train.py``)."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        if "RANK" not in env or "WORLD_SIZE" not in env:
            have, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
            raise EnvError(f"{have} is set but {missing} is not; a launcher sets both. {HOW_TO_START}")
        return _check(_from_torch(env, default_port))
    found = _from_mpi(env, default_port) or _from_slurm(env, default_port) or _from_kubeflow_pod(env)
    return _check(found) if found is not None else None
