"""`init_inference(checkpoint=...)` takes a weight source already opened, as `load_pretrained` passes one (a model
folder, maybe chained with an adapter); an object that is neither a path, a descriptor nor a source is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.config import ConfigError
from shardwise.config.inference import parse_inference_config


class Source:
    def find(self, name: str) -> str | None:
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        return ()

    def read(self, key: str, shard: object, dtype: object) -> object:
        return None


def test_checkpoint_takes_a_path_a_descriptor_or_an_opened_source() -> None:
    source = Source()
    assert parse_inference_config(None, {"checkpoint": source}).checkpoint is source
    assert parse_inference_config(None, {"checkpoint": Path("/ckpt")}).checkpoint == "/ckpt"
    assert parse_inference_config(None, {"checkpoint": {"checkpoints": ["a.safetensors"]}}).checkpoint == {
        "checkpoints": ["a.safetensors"]}
    with pytest.raises(ConfigError, match=r"checkpoint: a path .*, a descriptor dict or a weight source .*; got object\."):
        parse_inference_config(None, {"checkpoint": object()})
