"""The loop every rank of `shardwise serve` runs (`python -m shardwise.inference.serve.worker`, under the launcher).

Rank 0 (the lead) serves HTTP on a second thread and, on its main thread, takes batches of queued prompts,
broadcasts each to the other tensor-parallel ranks, generates with them, decodes and resolves the requests'
futures. The other ranks (followers) wait for rank 0's next message and generate with it. A SIGTERM or SIGINT on
rank 0 ends the loop: queued requests are refused (503), "stop" is broadcast, and every rank exits with 0.
Followers ignore those signals and wait for the "stop" (the launcher sends them the signal too).

[Note: idle followers] A follower waits for the next batch inside a broadcast, which the process group bounds by
its timeout (30 minutes); an idle rank 0 therefore sends "idle" every `IDLE_PING_S`, so a quiet server is not
mistaken for a hung one.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ...distributed.pending import CollectiveError
from .batching import Batch, Message, RequestQueue, Row, ShuttingDown, left_padded
from .options import build_parser, listening_socket, load_options
from .protocol import finish

logger = logging.getLogger(__name__)

IDLE_PING_S = 60.0
"""Longest silence between rank 0's messages (see [Note: idle followers])."""
POLL_S = 0.1
"""How long rank 0 waits for a request before looking at its stop flag again."""


class Channel:
    """Rank 0's messages to the other ranks of the tensor-parallel group (nothing to send at tp 1)."""

    def __init__(self, engine: Any):
        self.group = engine.link.group.pg if engine.tp_size > 1 else None
        nccl = self.group is not None and dist.get_backend(self.group) == "nccl"
        self.device = engine.device_ if nccl else None  # nccl moves the pickled bytes through this device
        self.last_sent = time.monotonic()

    def send(self, message: Message) -> None:
        if self.group is not None:
            dist.broadcast_object_list([message], group=self.group, group_src=0, device=self.device)
        self.last_sent = time.monotonic()

    def receive(self) -> Message:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, group=self.group, group_src=0, device=self.device)
        return box[0]


def generate(engine: Any, batch: Batch) -> list[list[int]]:
    """Every rank's call: the batch's new tokens per row (rows that ended early are padded)."""
    if batch.sampling.seed is not None and not batch.sampling.greedy:
        torch.manual_seed(batch.sampling.seed)  # the engine gives every rank rank 0's generator state
    ids = torch.tensor(batch.input_ids, dtype=torch.long)
    out = engine.generate(input_ids=ids, attention_mask=torch.tensor(batch.attention_mask, dtype=torch.long),
                          max_new_tokens=batch.max_new_tokens, pad_token_id=batch.pad_token_id,
                          eos_token_id=batch.eos_token_id, **batch.sampling.generate_kwargs())
    return out[:, ids.shape[1]:].tolist()


class RanksOutOfStep(RuntimeError):
    """A batch failed on some ranks of the group and not on others: they no longer run the same steps."""


def generate_together(engine: Any, batch: Batch) -> tuple[list[list[int]] | None, Exception | None]:
    """`generate` on every rank, then one all-reduce of whether it failed: an error every rank met (a prompt the
    engine refuses) fails the batch and the server goes on; an error on some ranks only (memory on one device),
    or a collective that failed, leaves the ranks out of step, so it stops the server on every rank instead."""
    try:
        out, error = generate(engine, batch), None
    except CollectiveError:
        raise
    except Exception as caught:  # noqa: BLE001 - judged below, together with the other ranks
        out, error = None, caught
    if engine.tp_size > 1:
        if not engine.link.agrees(torch.tensor([int(error is not None)], dtype=torch.int64, device=engine.device_)):
            raise RanksOutOfStep(f"shardwise serve: a batch failed on some tensor-parallel ranks only ({error!r} on "
                                 f"rank {engine.tp_rank}); the ranks are out of step, so the server stops.")
    return out, error


class Lead:
    """Rank 0's loop: batches from the queue, generated with the group, decoded into the rows' futures."""

    def __init__(self, engine: Any, channel: Channel, queue: RequestQueue, tokens: Any, max_batch_size: int,
                 max_out_tokens: int):
        self.engine, self.channel, self.queue, self.tokens = engine, channel, queue, tokens
        self.max_batch_size, self.max_out_tokens = max_batch_size, max_out_tokens

    def step(self) -> bool:
        """Generate one batch if a request comes within `POLL_S`; whether one did."""
        rows = self.queue.take(self.max_batch_size, self.max_out_tokens, POLL_S)
        if not rows:
            if time.monotonic() - self.channel.last_sent > IDLE_PING_S:
                self.channel.send("idle")
            return False
        self.run(rows)
        return True

    def run(self, rows: list[Row]) -> None:
        from .app import GenerationError

        batch = left_padded(rows, self.tokens.pad_token_id, sorted(self.tokens.eos_token_ids))
        self.channel.send(batch)
        try:
            generated, error = generate_together(self.engine, batch)
        except Exception as fatal:
            for row in rows:
                row.future.set_exception(GenerationError(f"{type(fatal).__name__}: {fatal}"))
            raise
        if error is not None:  # every rank failed alike: the requests get the error (500); the server goes on
            logger.error("shardwise serve: a batch of %d prompt(s) failed: %r", len(rows), error)
            for row in rows:
                row.future.set_exception(GenerationError(f"{type(error).__name__}: {error}"))
            return
        for row, tokens in zip(rows, generated):
            try:
                row.future.set_result(finish(tokens, self.tokens.decode, self.tokens.eos_token_ids, row.max_tokens,
                                             row.stops))
            except Exception as error:  # noqa: BLE001 - a decoding failure fails its own request only
                row.future.set_exception(GenerationError(f"{type(error).__name__}: {error}"))

    def stop(self) -> None:
        """Refuse what is still queued and tell the other ranks to exit."""
        for row in self.queue.close():
            row.future.set_exception(ShuttingDown("the server is shutting down"))
        self.channel.send("stop")


def follow(engine: Any, channel: Channel) -> None:
    """A rank other than 0: generate whatever rank 0 sends until it says stop."""
    while True:
        message = channel.receive()
        if message == "stop":
            return
        if isinstance(message, Batch):
            _, error = generate_together(engine, message)
            if error is not None:  # rank 0 failed the same way and answers the request with it
                logger.error("shardwise serve: a batch failed on this rank too: %r", error)


@contextlib.contextmanager
def stop_requested(lead: bool) -> Iterator[threading.Event]:
    """A flag SIGTERM/SIGINT set. On rank 0 a second signal stops the process at once; the other ranks only note
    it: they stop when rank 0 says so. The previous handlers come back on leaving."""
    flag = threading.Event()

    def on_signal(signum: int, _: Any) -> None:
        if lead and flag.is_set():
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        flag.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(options: argparse.Namespace) -> int:
    """Load the model on this rank, then run the lead's or a follower's loop until stopped."""
    listener = listening_socket(options.host, options.port) if _rank() == 0 else None  # a taken port fails first
    engine = load_engine(options)
    channel = Channel(engine)
    with stop_requested(engine.tp_rank == 0) as flag:
        if engine.tp_rank != 0:
            follow(engine, channel)
        else:
            _lead(engine, channel, options, listener, flag)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"shardwise serve: rank {engine.tp_rank} of {engine.tp_size} stopped", flush=True)
    return 0


def _lead(engine: Any, channel: Channel, options: argparse.Namespace, listener: socket.socket,
          flag: threading.Event) -> None:
    import transformers
    import uvicorn

    from .app import Frontend, Tokens, create_app

    queue = RequestQueue()
    tokens = Tokens(transformers.AutoTokenizer.from_pretrained(options.model), _model_eos_ids(engine))
    frontend = Frontend(queue, tokens, options.served_model_name, options.max_out_tokens)
    server = uvicorn.Server(uvicorn.Config(create_app(frontend), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="shardwise-serve-http",
                            daemon=True)
    http.start()
    lead = Lead(engine, channel, queue, tokens, options.max_batch_size, options.max_out_tokens)
    host, port = listener.getsockname()[:2]
    print(f"shardwise serve: {options.served_model_name} on http://{host}:{port}/v1 "
          f"(tensor-parallel size {engine.tp_size})", flush=True)
    try:
        while not flag.is_set() and http.is_alive():
            lead.step()
    finally:
        server.should_exit = True
        lead.stop()
        http.join(timeout=10)
    if not flag.is_set():
        raise RuntimeError("shardwise serve: the HTTP server stopped by itself (its error is above); the other ranks "
                           "were told to stop.")


def _model_eos_ids(engine: Any) -> list[int]:
    eos = getattr(getattr(engine.module, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def load_engine(options: argparse.Namespace) -> Any:
    from ..pretrained import load_pretrained

    kwargs: dict[str, Any] = {"tensor_parallel": {"tp_size": options.tp}, "max_out_tokens": options.max_out_tokens}
    if options.dtype is not None:
        kwargs["dtype"] = options.dtype
    if options.int8:
        kwargs["quant"] = {"enabled": True}
    return load_pretrained(options.model, checkpoint=options.checkpoint, adapter=options.adapter, **kwargs)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str]) -> int:
    return serve(load_options(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
