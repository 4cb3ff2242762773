"""`shardwise serve`'s options: parsed and checked without torch, by the command and by each rank alike.

Apart from cli.py because the ranks (worker.py) read the same options that the command (cli.py) starts them with,
and cli.py starts worker.py: one module each way would be an import circle."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path


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
