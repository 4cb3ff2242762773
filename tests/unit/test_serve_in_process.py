"""`shardwise serve --tp 1`, which runs in the calling process: the real tiny model behind the real HTTP server,
driven from a client thread while the server's loop holds the main thread; stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from shardwise.inference.serve import cli, worker
from tests.serve_checks import MAX_OUT_TOKENS, Expected, check_server, post, wait_for_health
from tests.tiny_llm import PROMPTS, write_tiny_llama

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_while(folder: Path, drive: Callable[[str], Any]) -> tuple[int, Any]:
    """`shardwise serve --tp 1` on this (main) thread while `drive(url)` runs on another, which SIGTERMs this
    process when done; (exit status, what drive returned)."""
    port, outcome = _free_port(), {}
    url = f"http://127.0.0.1:{port}"

    def client() -> None:
        try:
            wait_for_health(url, alive=lambda: True, timeout=90)
            outcome["value"] = drive(url)
        except BaseException as error:  # noqa: BLE001 - re-raised on the main thread
            outcome["error"] = error
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    ignore = lambda *_: None  # noqa: E731 - a SIGTERM that comes before serve's handler must not end pytest
    previous = signal.signal(signal.SIGTERM, ignore)
    try:
        thread = threading.Thread(target=client)
        thread.start()
        status = cli.main(["--model", str(folder), "--port", str(port), "--max_out_tokens", str(MAX_OUT_TOKENS),
                           "--max_batch_size", "4", "--served_model_name", "tiny-served"])
        thread.join()
        assert signal.getsignal(signal.SIGTERM) is ignore  # serve put back the handler it found
    finally:
        signal.signal(signal.SIGTERM, previous)
    if "error" in outcome:
        raise outcome["error"]
    return status, outcome["value"]


def test_completions_match_the_model_alone_and_refusals_name_the_field(tiny: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    want = Expected(tiny)
    status, _ = serve_while(tiny, lambda url: check_server(url, want))
    assert status == 0
    out = capsys.readouterr().out
    assert "shardwise serve: tiny-served on http://127.0.0.1:" in out and "(tensor-parallel size 1)" in out
    assert "shardwise serve: rank 0 of 1 stopped" in out


def test_a_failing_batch_answers_500_and_the_server_keeps_serving(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = worker.generate

    def generate(engine: Any, batch: Any) -> Any:
        if batch.max_new_tokens == 7:
            raise RuntimeError("the device ran out of memory (on purpose)")
        return real(engine, batch)

    monkeypatch.setattr(worker, "generate", generate)

    def drive(url: str) -> tuple[httpx.Response, httpx.Response]:
        return post(url, {"prompt": PROMPTS[0], "max_tokens": 7}), post(url, {"prompt": PROMPTS[0], "max_tokens": 3})

    status, (failed, after) = serve_while(tiny, drive)
    assert status == 0
    assert failed.status_code == 500 and failed.json()["error"] == {
        "message": "generation failed: RuntimeError: the device ran out of memory (on purpose)",
        "type": "server_error", "param": None, "code": None}
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
