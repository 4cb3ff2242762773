"""What a client of `shardwise serve` checks, shared by the in-process (tp 1) and the launched (tp 2) tests.

Every greedy completion is compared with the plain transformers model generating for its prompt alone
(tests/tiny_llm.py's oracle), whatever batch the server put the prompt in; usage and finish reasons are worked
out here from the oracle's tokens, independently of the server's code.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx

from tests.tiny_llm import PROMPTS, greedy_oracle

MAX_OUT_TOKENS = 64
ORACLE_TOKENS = 12


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def wait_for_health(url: str, alive: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert alive(), "the server stopped before answering /health"
        try:
            if httpx.get(f"{url}/health", timeout=2).json() == {"status": "ok"}:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"no answer from {url}/health within {timeout} s")


class Expected:
    """The oracle's completions, cut as a client expects them."""

    def __init__(self, folder: Path):
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.eos = self.tokenizer.eos_token_id
        self.oracle = greedy_oracle(folder, PROMPTS, ORACLE_TOKENS)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def choice(self, prompt: str, max_tokens: int) -> tuple[str, str, int]:
        """(text, finish_reason, completion tokens) of `prompt` alone with `max_tokens` (greedy: a prefix of the
        oracle's tokens, ending at its end-of-sequence token if it wrote one)."""
        ids = self.oracle[prompt][:max_tokens]
        if self.eos in ids:
            end = ids.index(self.eos)
            return self.decode(ids[:end]), "stop", end + 1
        return self.decode(ids), "length", len(ids)

    def prompt_tokens(self, prompt: str) -> int:
        return len(self.tokenizer(prompt).input_ids)


def check_choice(choice: dict, expected: tuple[str, str, int], index: int) -> int:
    assert (choice["index"], choice["text"], choice["finish_reason"], choice["logprobs"]) == \
        (index, expected[0], expected[1], None), f"got {choice}, expected {expected}"
    return expected[2]


def check_greedy_batches(url: str, want: Expected) -> None:
    """One request with several prompts (one batch, left-padded), then 8 concurrent requests (batched however
    they arrive): each prompt's text is the oracle's for that prompt alone."""
    prompts = PROMPTS[:4]
    body = post(url, {"model": "tiny-served", "prompt": prompts, "max_tokens": ORACLE_TOKENS, "temperature": 0}).json()
    assert body["object"] == "text_completion" and body["model"] == "tiny-served" and body["id"].startswith("cmpl-")
    used = sum(check_choice(c, want.choice(p, ORACLE_TOKENS), i) for i, (c, p) in enumerate(zip(body["choices"], prompts)))
    given = sum(want.prompt_tokens(p) for p in prompts)
    assert body["usage"] == {"prompt_tokens": given, "completion_tokens": used, "total_tokens": given + used}

    jobs = [(PROMPTS[i % len(PROMPTS)], 5 + i % (ORACLE_TOKENS - 4)) for i in range(1, 9)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: post(url, {"prompt": job[0], "max_tokens": job[1], "temperature": 0.0}),
                                jobs))
    for (prompt, max_tokens), reply in zip(jobs, replies):
        assert reply.status_code == 200, reply.text
        body = reply.json()
        used = check_choice(body["choices"][0], want.choice(prompt, max_tokens), 0)
        given = want.prompt_tokens(prompt)
        assert body["usage"] == {"prompt_tokens": given, "completion_tokens": used, "total_tokens": given + used}


def check_stop_string(url: str, want: Expected) -> None:
    """A word the model writes, given as stop: the text ends before it, counted up to the token completing it."""
    prompt, word = next((p, w) for p in PROMPTS for w in re.findall(r"[A-Za-z]{3,}", want.choice(p, ORACLE_TOKENS)[0]))
    ids = want.oracle[prompt]
    text = want.choice(prompt, ORACLE_TOKENS)[0]
    tokens = next(k for k in range(1, len(ids) + 1) if word in want.decode(ids[:k]))
    body = post(url, {"prompt": prompt, "max_tokens": ORACLE_TOKENS, "temperature": 0, "stop": [word, "\x00"]}).json()
    assert body["choices"][0]["text"] == text[:text.index(word)] and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == tokens


def check_seeded_sampling(url: str) -> None:
    """The same seed gives the same text (on every tensor-parallel rank alike, or the text would be garbage or the
    ranks would disagree); another seed another text."""
    def sample(seed: int) -> str:
        reply = post(url, {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": seed})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    first = sample(1234)
    assert sample(1234) == first and sample(99) != first


def check_refusals(url: str) -> None:
    def error(body: dict, status: int) -> dict[str, Any]:
        reply = post(url, body)
        assert reply.status_code == status, reply.text
        return reply.json()["error"] if status != 422 else reply.json()

    n = error({"prompt": "hi", "n": 2}, 400)
    assert n["param"] == "n" and n["message"].startswith("n: shardwise serve returns one completion per prompt")
    stream = error({"prompt": "hi", "stream": True}, 400)
    assert stream["param"] == "stream" and "streaming responses are not supported" in stream["message"]
    long = error({"prompt": " ".join(["apple"] * 60), "max_tokens": 16}, 400)
    assert long["param"] == "prompt" and f"exceeds the server's max_out_tokens ({MAX_OUT_TOKENS})" in long["message"]
    assert "--max_out_tokens" in long["message"]
    other = error({"model": "gpt-4", "prompt": "hi"}, 404)
    assert other["message"] == ("model: this server serves 'tiny-served'; got 'gpt-4'. Ask for that model "
                                "(GET /v1/models lists it), or leave model out.")
    assert any("prompt" in detail["loc"] for detail in error({"prompt": 5}, 422)["detail"])


def check_models(url: str) -> None:
    listed = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["tiny-served"]


def check_server(url: str, want: Expected) -> None:
    check_models(url)
    check_greedy_batches(url, want)
    check_stop_string(url, want)
    check_seeded_sampling(url)
    check_refusals(url)
