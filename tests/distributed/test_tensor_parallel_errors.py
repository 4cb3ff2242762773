"""What a user sees when tensor parallelism cannot do what was asked: the exact message, raised alike on every
rank at `initialize` (none hangs in a collective). The cases run one after another in one group of 3 ranks."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.config import ConfigError
from shardwise.tensor_parallel import TensorParallelError
from shardwise.tensor_parallel.megatron import tp_model_init
from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")

WORLD = 3
BUILT_IN = "bert, gpt2, llama, mistral, opt, qwen2, qwen3, roberta"


def _llama(heads: int = 4, kv_heads: int = 2, hidden: int = 32):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.Linear(12, 6)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


class _TiedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(12, 6), torch.nn.Linear(6, 12, bias=False)
        self.head.weight = self.embed.weight


def _gpt_neo():
    torch.manual_seed(0)
    return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=66, hidden_size=48, num_layers=1, num_heads=3, attention_types=[[["global"], 1]],
        max_position_embeddings=32))


def _specs(pattern: str, kind: str, use_default_specs: bool = True) -> dict:
    return {"partition_config": {"use_default_specs": use_default_specs,
                                 "layer_specs": [{"patterns": [pattern], "partition_type": kind}]}}


def _config(tp: int, **tensor_parallel) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "tensor_parallel": {"autotp_size": tp, **tensor_parallel}}


CASES = {
    "heads": (lambda: _llama(heads=4, kv_heads=4), _config(3)),
    "kv heads": (lambda: _llama(heads=6, kv_heads=2, hidden=48), _config(3)),
    "world": (_llama, _config(2)),
    "sizes differ": (lambda: tp_model_init(_llama(heads=6, kv_heads=3, hidden=48), tp_size=3), _config(2)),
    "vocabulary": (lambda: _llama(heads=6, kv_heads=3, hidden=48), _config(3)),
    "no match": (_Block, _config(3, **_specs(r"nothing\.weight", "row", use_default_specs=False))),
    "layer norm as column": (_Block, _config(3, **_specs(r".*\.norm\.weight$", "column"))),
    "tied to a whole module": (_TiedHead, _config(3, **_specs(r"head", "column"))),
    "unknown model type": (_gpt_neo, _config(3)),
}

MESSAGES = {
    "heads": (TensorParallelError, "tensor_parallel.autotp_size: 3 does not divide the model's num_attention_heads (4), "
              "so heads would be cut; choose a size that divides it."),
    "kv heads": (TensorParallelError, "tensor_parallel.autotp_size: 3 does not divide the model's num_key_value_heads "
                 "(2), so heads would be cut; choose a size that divides it."),
    "world": (ConfigError, "tensor_parallel.autotp_size: 1 pipeline stage(s) x 2 tensor-parallel ranks = 2 does not "
              "divide the world size (3); choose sizes whose product divides the number of processes."),
    "sizes differ": (ConfigError, "tensor_parallel: the tensor-parallel sizes given differ ({'tensor_parallel."
                     "autotp_size': 2, 'tp_model_init(tp_size=...)': 3}); give one size."),
    "vocabulary": (TensorParallelError, "model.embed_tokens.weight (shape (64, 48)): a dim of 64 (x1 blocks) cannot be "
                   "split evenly over 3 tensor-parallel ranks; choose a tensor-parallel size that divides it, or leave "
                   "the module out of the plan."),
    "no match": (TensorParallelError, "tensor_parallel: the plan matched no module of _Block, so nothing would be "
                 "split; check partition_config's patterns against model.named_modules()."),
    "layer norm as column": (TensorParallelError, "norm: a LayerNorm cannot be split as 'colwise'; column/row-parallel "
                             "styles take nn.Linear or transformers' Conv1D (or a PEFT LoRA wrapper of one), "
                             "vocab_embedding takes nn.Embedding. Leave it out of the plan (it stays whole on every "
                             "rank) or give it a style its type supports."),
    "tied to a whole module": (TensorParallelError, "tensor_parallel: ['embed.weight'] still hold the whole weight that "
                               "another module now holds split (the two were tied); split both modules alike (add a "
                               "rule for them) or set tensor_parallel.vocab_parallel_lm_head: false for embeddings."),
    "unknown model type": (TensorParallelError, f"tensor_parallel: no AutoTP plan for model type 'gpt_neo' "
                           f"(GPTNeoForCausalLM); built in: {BUILT_IN}, or any transformers model whose config has a "
                           "base_model_tp_plan. Give one with tensor_parallel.partition_config.layer_specs "
                           "({\"patterns\": [regex], \"partition_type\": \"column\"|\"row\"})."),
}


def _each_case() -> dict[str, tuple[type, str] | None]:
    seen = {}
    for name, (build, config) in CASES.items():
        try:
            shardwise.initialize(model=build(), config=config)
            seen[name] = None
        except Exception as e:  # noqa: BLE001 - the type and message are what the test asserts
            seen[name] = (type(e), str(e))
    return seen


@pytest.fixture(scope="module")
def seen():
    for build, _ in CASES.values():  # the ranks fork with transformers' model modules imported
        build()
    return run_distributed(_each_case, WORLD, timeout=120)


@pytest.mark.parametrize("name", list(CASES))
def test_user_error_message(seen, name):
    expected_type, expected = MESSAGES[name]
    for rank, errors in enumerate(seen):
        assert errors[name] is not None, f"rank {rank}: {name} was accepted"
        kind, message = errors[name]
        assert issubclass(kind, expected_type) and issubclass(kind, ValueError), (rank, kind)
        assert message == expected, f"rank {rank}"
