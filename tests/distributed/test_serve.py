"""`shardwise serve --tp 2` as a user runs it: a real subprocess that starts two ranks through the launcher, a
real HTTP client sending concurrent requests, and a SIGTERM that every rank answers by exiting 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_launcher import child_env
from tests.serve_checks import MAX_OUT_TOKENS, Expected, check_server, wait_for_health
from tests.tiny_llm import write_tiny_llama

pytestmark = [pytest.mark.timeout(240)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_at_tp2_matches_the_model_alone_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "tiny")
    port, log = _free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "shardwise.cli", "serve", "--model", str(folder), "--tp", "2",
             "--port", str(port), "--max_out_tokens", str(MAX_OUT_TOKENS), "--max_batch_size", "4",
             "--served_model_name", "tiny-served"],
            cwd=tmp_path, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        want = Expected(folder)  # the oracle runs while the ranks load
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, alive=lambda: server.poll() is None)
        check_server(url, want)
        server.send_signal(signal.SIGTERM)
        status = server.wait(timeout=15)  # rank 0 ends its loop within POLL_S; start-up is not timed here
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    said = log.read_text()
    assert status == 0, said  # the agent exits 0 only when every rank did: it did not stop them itself
    assert "shardwise serve: tiny-served on http://127.0.0.1:" in said and "(tensor-parallel size 2)" in said
    assert "shardwise serve: rank 0 of 2 stopped" in said and "shardwise serve: rank 1 of 2 stopped" in said, said
