"""Prompt/response data for supervised fine-tuning: JSONL reading, formatting, response-only labels,
padding or packing, and the token-level loss.

A record is ``{"prompt": ..., "response": ...}`` (the shape of Dahoas/rm-static, whose prompts are
``"\\n\\nHuman: ...\\n\\nAssistant:"`` turns). Two formats:

* ``chat``: the prompt's turns become chat messages rendered by the tokenizer's chat template with the
  generation prompt appended; the response (stripped) follows, then end-of-sequence.
* ``plain``: ``prompt + response`` as written, with beginning- and end-of-sequence tokens.

Prompt and response are tokenized separately and concatenated, so the boundary between them is exact
(no BPE merge crosses it) and the labels are -100 on every prompt token: the loss is taken only on the
response and its end-of-sequence token.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

IGNORE = -100
_TURN = re.compile(r"\n\n(Human|Assistant):")


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]


def load_pairs(path: str | Path) -> list[dict[str, str]]:
    """Records of a JSONL file; each must have string `prompt` and `response` fields."""
    pairs = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}).") from None
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("prompt", "response")):
            raise ValueError(f"{path}:{line_no}: needs string fields 'prompt' and 'response'; got {line[:80]!r}.")
        pairs.append({"prompt": record["prompt"], "response": record["response"]})
    if not pairs:
        raise ValueError(f"{path}: no records.")
    return pairs


def split_pairs(pairs: list[dict[str, str]], eval_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle, then the last `eval_fraction` held out (at least one record when the fraction > 0)."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(pairs) * eval_fraction)) if eval_fraction > 0 else 0
    cut = len(pairs) - n_eval
    return [pairs[i] for i in order[:cut]], [pairs[i] for i in order[cut:]]


def to_messages(prompt: str) -> list[dict[str, str]]:
    """rm-static's ``\\n\\nHuman: ...\\n\\nAssistant: ...`` turns as chat messages; other text is one user turn."""
    parts = _TURN.split(prompt)
    if len(parts) == 1:
        return [{"role": "user", "content": prompt.strip()}]
    messages = []
    for role, text in zip(parts[1::2], parts[2::2]):
        if text.strip():
            messages.append({"role": "user" if role == "Human" else "assistant", "content": text.strip()})
    return messages


def prompt_ids(tokenizer: Any, prompt: str, template: str) -> list[int]:
    """Token ids of the prompt, ending where the model's answer starts."""
    if template == "chat":
        text = tokenizer.apply_chat_template(to_messages(prompt), tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + list(tokenizer(prompt, add_special_tokens=False).input_ids)


def encode_pair(tokenizer: Any, prompt: str, response: str, template: str, max_seq_len: int) -> Example:
    """Ids and labels of one pair; too long, the prompt loses tokens from its start, then the response its end."""
    if template not in ("chat", "plain"):
        raise ValueError(f"template: must be 'chat' or 'plain'; got {template!r}.")
    head = prompt_ids(tokenizer, prompt, template)
    answer = response.strip() if template == "chat" else response
    tail = list(tokenizer(answer, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]
    tail = tail[:max_seq_len - 1]  # at least one prompt token stays, so the first answer token has a context
    head = head[max(0, len(head) + len(tail) - max_seq_len):]
    return Example(head + tail, [IGNORE] * len(head) + tail)


def encode_all(tokenizer: Any, pairs: Sequence[dict[str, str]], template: str, max_seq_len: int) -> list[Example]:
    return [encode_pair(tokenizer, p["prompt"], p["response"], template, max_seq_len) for p in pairs]


def pack(examples: Sequence[Example], max_seq_len: int) -> list[Example]:
    """Concatenate examples into rows of exactly `max_seq_len` tokens (the remainder is dropped).

    Attention crosses example boundaries within a row (as in the usual constant-length packing); each
    example's labels still cover only its response.
    """
    ids: list[int] = []
    labels: list[int] = []
    for ex in examples:
        ids += ex.input_ids
        labels += ex.labels
    rows = len(ids) // max_seq_len
    return [Example(ids[i * max_seq_len:(i + 1) * max_seq_len], labels[i * max_seq_len:(i + 1) * max_seq_len])
            for i in range(rows)]


class SFTDataset(torch.utils.data.Dataset):
    def __init__(self, examples: Sequence[Example]):
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]


class PadCollator:
    """Right-pads a list of examples to the longest: input_ids (pad id), attention_mask (0), labels (-100)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        width = max(len(ex.input_ids) for ex in examples)
        ids = torch.full((len(examples), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for row, ex in enumerate(examples):
            n = len(ex.input_ids)
            ids[row, :n] = torch.tensor(ex.input_ids)
            labels[row, :n] = torch.tensor(ex.labels)
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def target_count(labels: torch.Tensor) -> int:
    """Tokens that carry a loss: labels after the one-position shift that are not -100."""
    return int((labels[:, 1:] != IGNORE).sum())


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over the response tokens (logits at t predict labels at t+1), in fp32."""
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum")
