"""`shardwise serve`: an OpenAI-style completions endpoint for a Hugging Face causal LM, split over `--tp` local
processes.

    shardwise serve --model DIR [--checkpoint CKPT] [--adapter DIR] [--tp N] [--dtype fp32|bf16|fp16] [--int8]
                    [--max_out_tokens 1024] [--max_batch_size 8] [--host 127.0.0.1] [--port 8000]
                    [--served_model_name NAME]

At `--tp 1` the server runs in this process. Otherwise the launcher's local launch (torch's elastic agent) starts
`--tp` ranks of `shardwise.inference.serve.worker` with the same options, and this process is their agent.

[Note: stopping the ranks] A SIGTERM or SIGINT to this process is passed to the ranks as SIGTERM, which rank 0
answers by broadcasting "stop": every rank exits 0 and so does this command (the elastic agent, left to itself,
would signal the ranks and exit 143 whatever they did). For that the agent is told to leave those two signals to
us (`LocalLaunch.agent_signals`), and the ranks note their pids in a file (the launcher's `--save_pid` mechanism).
A second signal kills the ranks at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sys
import tempfile
from typing import Any, Iterator

from .options import ServeOptionError, build_parser, listening_socket, load_options

WORKER_MODULE = "shardwise.inference.serve.worker"


def _check_installed() -> None:
    missing = [m for m in ("fastapi", "uvicorn", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ServeOptionError(f"shardwise serve needs {', '.join(missing)}; install them with "
                               "pip install 'shardwise[serve,finetune]'.")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        load_options(args)
        _check_installed()
        listening_socket(args.host, args.port).close()
    except ServeOptionError as error:
        print(f"shardwise serve: error: {error}", file=sys.stderr, flush=True)
        return 2
    if args.tp == 1:
        from .worker import serve

        return serve(args)
    return launch(args.tp, argv)


def launch(tp: int, argv: list[str]) -> int:
    """`tp` ranks of the worker on this machine, through the launcher's local launch."""
    from shardwise.launcher import local

    gpus = local.visible_cuda_devices()
    if 0 < gpus < tp:
        print(f"shardwise serve: error: --tp {tp}: this machine has {gpus} visible CUDA device(s); ask for at most "
              f"{gpus} or check CUDA_VISIBLE_DEVICES.", file=sys.stderr, flush=True)
        return 2
    plan = local.LocalLaunch(nproc=tp, script=WORKER_MODULE, script_args=tuple(argv), module=True,
                             pass_local_rank=False, master_port=local.pick_default_master_port(),
                             agent_signals="SIGHUP,SIGQUIT")
    with ranks_stopped_by_signals():
        return local.launch_local(plan)


@contextlib.contextmanager
def ranks_stopped_by_signals() -> Iterator[None]:
    """SIGTERM/SIGINT passed on to the ranks while the launcher runs (see [Note: stopping the ranks])."""
    from shardwise.launcher.bootstrap import PID_FILE_VAR  # stdlib only

    handle, pid_file = tempfile.mkstemp(prefix="shardwise-serve-", suffix=".pids")
    os.close(handle)
    saved_pid_file = os.environ.get(PID_FILE_VAR)
    os.environ[PID_FILE_VAR] = pid_file
    received: list[int] = []

    def forward(signum: int, _: Any) -> None:
        received.append(signum)
        for pid in rank_pids(pid_file):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if len(received) == 1 else signal.SIGKILL)

    saved_handlers = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved_handlers.items():
            signal.signal(sig, handler)
        if saved_pid_file is None:
            os.environ.pop(PID_FILE_VAR, None)
        else:
            os.environ[PID_FILE_VAR] = saved_pid_file
        os.unlink(pid_file)


def rank_pids(pid_file: str) -> list[int]:
    """The pids the ranks noted ('rank<R> <host> <pid>' lines)."""
    with open(pid_file) as f:
        return [int(parts[2]) for parts in (line.split() for line in f) if len(parts) == 3 and
                parts[0].startswith("rank")]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
