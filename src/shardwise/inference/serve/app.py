"""The HTTP side of `shardwise serve`, on tensor-parallel rank 0: a FastAPI app that checks and tokenizes each
request, queues its prompts for the generation loop (worker.py) and answers when their futures resolve.

The app runs in its own thread (uvicorn's event loop) and never touches the model: the loop, on the main thread,
is the only caller of `generate`, so the tensor-parallel ranks see one sequence of batches.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .batching import RequestQueue, Row, Sampling, ShuttingDown
from .protocol import CompletionRequest, CompletionResponse, completion_response, error_body, unsupported


class ServeError(Exception):
    """A request answered with an error: OpenAI's error body, with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class GenerationError(RuntimeError):
    """`generate` raised for the batch a request was in; the message is the error's."""


class Tokens:
    """The tokenizer behind a lock: the HTTP thread encodes while the loop decodes, and a fast tokenizer's Rust
    object refuses concurrent use ("Already borrowed")."""

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int] = ()):
        """`eos_token_ids`: end-of-sequence ids besides the tokenizer's (a model's generation config may list
        several, e.g. an end-of-turn token)."""
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        eos = tokenizer.eos_token_id
        self.eos_token_ids = frozenset([*eos_token_ids, *([eos] if eos is not None else [])])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.pad_token_id = pad if pad is not None else 0  # any id pads: padded positions are masked out

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer(text).input_ids)

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class Frontend:
    """What the app needs from the server: the queue into the loop, the tokenizer and the limits."""

    queue: RequestQueue
    tokens: Tokens
    served_model_name: str
    max_out_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(frontend: Frontend) -> FastAPI:
    app = FastAPI(title="shardwise serve", docs_url=None, redoc_url=None)

    @app.exception_handler(ServeError)
    async def _refused(_: Request, error: ServeError) -> JSONResponse:
        return JSONResponse(error_body(error.message, error.kind, error.param), status_code=error.status)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": frontend.served_model_name, "object": "model",
                                            "created": frontend.created, "owned_by": "shardwise"}]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> CompletionResponse:
        rows = _rows(frontend, request)
        try:
            frontend.queue.submit(rows)
            finished = await asyncio.gather(*(asyncio.wrap_future(r.future) for r in rows))
        except ShuttingDown as e:
            raise ServeError(503, f"{e}; send the request again once the server is back.", kind="server_error") from e
        except GenerationError as e:
            raise ServeError(500, f"generation failed: {e}", kind="server_error") from e
        return completion_response(frontend.served_model_name, [len(r.prompt_ids) for r in rows], finished)

    return app


def _rows(frontend: Frontend, request: CompletionRequest) -> list[Row]:
    """The request's prompts as queue rows; `ServeError` (400/404) for what the server refuses."""
    refused = unsupported(request)
    if refused is not None:
        raise ServeError(400, refused[1], param=refused[0])
    if request.model is not None and request.model != frontend.served_model_name:
        raise ServeError(404, f"model: this server serves {frontend.served_model_name!r}; got {request.model!r}. "
                              "Ask for that model (GET /v1/models lists it), or leave model out.",
                         param="model", kind="not_found_error")
    sampling = Sampling(request.temperature, request.top_p, request.seed)
    rows = []
    for i, prompt in enumerate(request.prompts):
        ids = frontend.tokens.encode(prompt)
        which = "prompt" if isinstance(request.prompt, str) else f"prompt[{i}]"
        if not ids:
            raise ServeError(400, f"{which}: the tokenizer makes no tokens of it; got {prompt!r}. Send some text.",
                             param="prompt")
        if len(ids) + request.max_tokens > frontend.max_out_tokens:
            raise ServeError(400, f"{which}: {len(ids)} prompt tokens + max_tokens {request.max_tokens} = "
                                  f"{len(ids) + request.max_tokens} exceeds the server's max_out_tokens "
                                  f"({frontend.max_out_tokens}), the length of its key/value cache; shorten the "
                                  "prompt, ask for fewer tokens, or start the server with a larger --max_out_tokens.",
                             param="prompt")
        rows.append(Row(ids, request.max_tokens, sampling, request.stops))
    return rows
