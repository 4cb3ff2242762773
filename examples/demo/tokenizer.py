"""Byte-level tokenizer for the demo: each UTF-8 byte is one token, so there is nothing to train or download."""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back; ids are 0..255."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # A model can emit a byte sequence that is not valid UTF-8 (half of a multi-byte character);
        # show it as U+FFFD rather than failing.
        return bytes(ids).decode("utf-8", errors="replace")
