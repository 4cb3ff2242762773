"""The wire format of `shardwise serve`: OpenAI's completions API (`POST /v1/completions`), as pydantic models, and
the pure rules that turn generated tokens into a choice (where the text ends and why).

Types are checked by pydantic (FastAPI answers a wrong type or an unknown key with 422). A field OpenAI defines
that shardwise serve does not implement is accepted only at its neutral value; any other value is refused by name
(`unsupported`, answered with 400) rather than ignored, so a client never gets a result computed differently from
what it asked for.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length"]


class CompletionRequest(BaseModel):
    """The body of `POST /v1/completions`."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    """0 is greedy decoding (the most likely token each step); above 0, sampling at this temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    echo: bool = False
    stream: bool = False
    user: str | None = None
    """Accepted and ignored (OpenAI uses it for abuse monitoring)."""
    # OpenAI's fields that shardwise serve accepts only at their neutral value (see `unsupported`).
    logprobs: int | None = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    stream_options: dict | None = None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


_NEUTRAL = [  # (field, allowed values, what to do instead)
    ("n", (1,), "shardwise serve returns one completion per prompt; send the request n times (with different "
     "seeds) for several samples"),
    ("stream", (False,), "streaming responses are not supported by shardwise serve; send stream=false (the "
     "default) to get the whole completion in one response"),
    ("echo", (False,), "shardwise serve does not echo the prompt; prepend it to the returned text yourself"),
    ("logprobs", (None,), "shardwise serve does not return log-probabilities; leave logprobs out"),
    ("best_of", (None, 1), "shardwise serve generates one candidate per prompt; leave best_of out"),
    ("presence_penalty", (0.0,), "shardwise serve applies no presence penalty; leave it out (0)"),
    ("frequency_penalty", (0.0,), "shardwise serve applies no frequency penalty; leave it out (0)"),
    ("logit_bias", (None, {}), "shardwise serve applies no logit bias; leave it out"),
    ("suffix", (None,), "shardwise serve does not complete insertions; leave suffix out"),
    ("stream_options", (None,), "streaming responses are not supported by shardwise serve; leave it out"),
]


def unsupported(request: CompletionRequest) -> tuple[str, str] | None:
    """(field, message) for the first thing in `request` shardwise serve refuses, or None."""
    for field, allowed, instead in _NEUTRAL:
        value = getattr(request, field)
        if value not in allowed:
            return field, f"{field}: {instead}; got {json.dumps(value)}."
    if not request.prompts:
        return "prompt", "prompt: at least one prompt is needed; got an empty list."
    if any(s == "" for s in request.stops):
        return "stop", "stop: an empty string would end every completion before it starts; got \"\". Remove it."
    return None


@dataclass(frozen=True)
class Finished:
    """One prompt's completion as the client sees it."""

    text: str
    finish_reason: FinishReason
    completion_tokens: int
    """Tokens the model generated for it, an end-of-sequence token included, up to where the text ends."""


def finish(generated: list[int], decode: Callable[[list[int]], str], eos_ids: frozenset[int], max_tokens: int,
           stops: tuple[str, ...]) -> Finished:
    """Where one row of a batch's output ends and why.

    `generated` holds the tokens after the prompt; a batch generates as many as its longest request asked for and
    pads rows that ended early, so the row is cut at its first end-of-sequence token ("stop"), else at
    `max_tokens` ("length"). A stop string then cuts the text before its first occurrence ("stop"); the tokens
    counted are those up to the one that completed the stop string."""
    tokens = generated[:max_tokens]
    end = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    reason: FinishReason = "length" if end is None else "stop"
    count = len(tokens) if end is None else end + 1
    body = tokens if end is None else tokens[:end]
    text = decode(body)
    cut = cut_at_stop(text, stops)
    if cut is None:
        return Finished(text, reason, count)
    return Finished(cut, "stop", _tokens_to_stop(body, decode, stops))


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """`text` up to (not including) the earliest occurrence of any stop string, or None if none occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(hits)] if hits else None


def _tokens_to_stop(tokens: list[int], decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> int:
    """The fewest leading tokens whose text holds a stop string (binary search: once a prefix's text holds one,
    every longer prefix's does)."""
    low, high = 1, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if cut_at_stop(decode(tokens[:middle]), stops) is None:
            low = middle + 1
        else:
            high = middle
    return high


class Choice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


def completion_response(model: str, prompt_tokens: list[int], finished: list[Finished]) -> CompletionResponse:
    """The response to a request whose prompts (`prompt_tokens` long each) completed as `finished`."""
    choices = [Choice(index=i, text=f.text, finish_reason=f.finish_reason) for i, f in enumerate(finished)]
    used = sum(f.completion_tokens for f in finished)
    return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model, choices=choices,
                              usage=Usage(prompt_tokens=sum(prompt_tokens), completion_tokens=used,
                                          total_tokens=sum(prompt_tokens) + used))


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    """OpenAI's error shape: clients (the `openai` package among them) read `error.message`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
