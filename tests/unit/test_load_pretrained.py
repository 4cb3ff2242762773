"""`load_pretrained` and `init_inference(checkpoint=...)` accept what they document: a Hugging Face folder (whose
weight source object load_pretrained hands to the config), a path as `pathlib.Path`; anything else is refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardwise.config import ConfigError
from shardwise.inference import empty_weights, init_inference, load_pretrained

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards and an index
    return tmp_path, model.eval()


def test_load_pretrained_gives_the_folder_model_logits(folder):
    path, model = folder
    engine = load_pretrained(str(path), max_out_tokens=32)
    ids = torch.arange(3, 13).view(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def test_init_inference_takes_a_path_object(folder):
    path, model = folder
    with empty_weights():
        empty = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    engine = init_inference(empty, checkpoint=path)
    ids = torch.arange(3, 13).view(1, 10)
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_another_kind_is_refused():
    with pytest.raises(ConfigError, match=r"checkpoint: a path .*, a descriptor dict or a weight source .*; got int\."):
        init_inference(torch.nn.Linear(2, 2), checkpoint=3)
