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

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

WORKER_MODULE = "shardwise.inference.serve.worker"


class ServeOptionError(ValueError):
    """A `shardwise serve` option that cannot work, found before any process starts."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise serve",
        description="Serve a Hugging Face causal LM over HTTP in the shape of OpenAI's completions API "
                    "(POST /v1/completions, GET /v1/models, GET /health), split over --tp local processes.")
    parser.add_argument("--model", required=True, help="Hugging Face model folder: config.json, safetensors "
                        "weights (unless --checkpoint gives them) and the tokenizer")
    parser.add_argument("--checkpoint", default=None, help="weights from here instead: a shardwise training "
                        "checkpoint, a safetensors folder or file, or a checkpoint descriptor JSON")
    parser.add_argument("--adapter", default=None, help="a PEFT LoRA adapter folder, merged into the weights")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size: local processes the model is "
                        "split over (default 1: this process)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="compute dtype (default: the model's own)")
    parser.add_argument("--int8", action="store_true", help="int8 weights (per-channel scales), computed in --dtype")
    parser.add_argument("--max_out_tokens", type=int, default=1024, help="key/value cache length: prompt plus new "
                        "tokens of a request may not exceed it (default 1024)")
    parser.add_argument("--max_batch_size", type=int, default=8, help="prompts generated together (default 8)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    parser.add_argument("--served_model_name", default=None, help="the name clients give as `model` (default: "
                        "the --model folder's name)")
    return parser


def load_options(args: argparse.Namespace) -> argparse.Namespace:
    """Checks that need no torch; fills the default served name. `ServeOptionError` names the option."""
    for flag, lowest in (("tp", 1), ("max_out_tokens", 2), ("max_batch_size", 1)):
        if getattr(args, flag) < lowest:
            raise ServeOptionError(f"--{flag}: must be at least {lowest}; got {getattr(args, flag)}.")
    if not 0 <= args.port < 65536:
        raise ServeOptionError(f"--port: must be between 0 and 65535; got {args.port}.")
    if not (Path(args.model) / "config.json").is_file():
        raise ServeOptionError(f"--model {args.model}: no config.json there; give a Hugging Face model folder "
                               "(what save_pretrained writes).")
    for flag in ("checkpoint", "adapter"):
        if getattr(args, flag) is not None and not Path(getattr(args, flag)).exists():
            raise ServeOptionError(f"--{flag} {getattr(args, flag)}: no such file or folder.")
    if args.served_model_name is None:
        args.served_model_name = Path(args.model).resolve().name
    return args


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), for the HTTP server to listen on."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise ServeOptionError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); choose "
                               "another port, or stop what uses it.") from None
    return sock


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
