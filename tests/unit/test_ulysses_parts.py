"""Ulysses' pieces that need no processes: kv-head replication, the loader adapter's cut (over a stand-in group
whose members all hold the same batch), and the refusals made before any collective."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ConfigError
from shardwise.distributed import Collectives
from shardwise.sequence_parallel import SequenceParallelError, SequenceShardLoader, kv_replication
from shardwise.sequence_parallel.hf import register_with_transformers, unregister_from_transformers
from shardwise.sequence_parallel.setup import sequence_parallel_size, setup_sequence_parallel
from tests import ulysses_models as um


class EchoLink:
    """A group of `size` ranks that all hold what this one holds."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def all_gather(self, local):
        return [local.clone() for _ in range(self.size)]

    def all_gather_rows(self, local):
        return self.all_gather(local)


@pytest.mark.parametrize("q, kv, size, copies", [(8, 8, 4, 1), (8, 4, 4, 1), (8, 2, 4, 2), (8, 1, 4, 4),
                                                 (12, 2, 4, 2), (8, 2, 8, 4), (6, 3, 2, 2)])
def test_kv_heads_are_replicated_only_as_far_as_needed(q, kv, size, copies):
    assert kv_replication(q, kv, size) == copies
    assert (kv * copies) % size == 0 and (q // kv) % copies == 0


def test_query_heads_that_do_not_divide_are_refused():
    with pytest.raises(SequenceParallelError, match="divides 6"):
        kv_replication(6, 2, 4)


def test_each_rank_gets_its_slice_with_the_next_tokens_labels():
    batch = um.sample(1)
    for rank in range(2):
        slices = SequenceShardLoader([batch], EchoLink(2, rank)).shard(dict(batch))
        assert len(slices) == 2
        piece = um.SEQ // 2
        got = slices[0]
        assert "labels" not in got
        torch.testing.assert_close(got["input_ids"], batch["input_ids"][:, rank * piece:(rank + 1) * piece])
        torch.testing.assert_close(got["position_ids"], batch["position_ids"][:, rank * piece:(rank + 1) * piece])
        shifted = torch.cat([batch["labels"][:, 1:], torch.full((1, 1), -100)], dim=1)
        torch.testing.assert_close(got["shift_labels"], shifted[:, rank * piece:(rank + 1) * piece])
    assert len(SequenceShardLoader([batch] * 3, EchoLink(2, 0))) == 6


@pytest.mark.parametrize("change, message", [
    (lambda b: b.pop("position_ids"), "needs position_ids"),
    (lambda b: b.__setitem__("attention_mask", torch.tensor([[0] * 2 + [1] * (um.SEQ - 2)])), "left padding"),
    (lambda b: [b.__setitem__(k, v[:, :-1]) for k, v in list(b.items())], "cannot be cut into 2"),
    (lambda b: b.__setitem__("attention_mask", torch.ones(1, 3)), "every tensor of the batch"),
])
def test_batches_ulysses_would_get_wrong_are_refused(change, message):
    batch = dict(um.sample(1))
    change(batch)
    with pytest.raises(SequenceParallelError, match=message):
        SequenceShardLoader([batch], EchoLink(2, 0)).shard(batch)


def test_right_padding_is_accepted():
    batch = dict(um.sample(1))
    batch["attention_mask"] = torch.tensor([[1] * (um.SEQ - 3) + [0] * 3])
    SequenceShardLoader([batch], EchoLink(2, 0)).shard(batch)


def test_sizes_from_the_config_and_the_mpu_must_agree():
    class Mpu:
        def get_sequence_parallel_world_size(self):
            return 4

    assert sequence_parallel_size({"sequence_parallel_size": 2}, None) == 2
    assert sequence_parallel_size({}, Mpu()) == 4
    assert sequence_parallel_size({"sequence_parallel_size": None}, None) == 1
    with pytest.raises(ConfigError, match="differ"):
        sequence_parallel_size({"sequence_parallel_size": 2}, Mpu())


def test_sequence_parallelism_beside_a_pipeline_is_refused():
    with pytest.raises(ConfigError, match="with pipeline parallelism is not supported yet"):
        setup_sequence_parallel(um.build(), 2, 2, 1, Collectives())


@pytest.mark.parametrize("extra, named", [
    ({"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}}, "tensor_parallel.sequence_parallel"),
    ({"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "random_ltd_layer_num": 1, "random_ltd_layer_id": [0], "model_type": "decoder", "total_layer_num": 2,
        "random_ltd_schedule": {"min_value": 8, "max_value": 16, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 10, "seq_per_step": 8}}}}}}, "random_ltd"),
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 16,
                              "schedule_type": "fixed_linear",
                              "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}}, "curriculum"),
])
def test_what_would_treat_a_slice_as_the_whole_sequence_is_refused(extra, named):
    from shardwise.config import parse_config
    from shardwise.sequence_parallel.setup import check_companions

    config = parse_config({**um.config(2, 0), **extra}, dp_size=1)
    with pytest.raises(ConfigError, match=named):
        check_companions(config, 2)
    check_companions(config, 1)


def test_models_whose_attention_needs_its_mask_are_refused():
    link = EchoLink(2, 0)
    eager = um.build()
    eager.set_attn_implementation("eager")
    try:
        with pytest.raises(SequenceParallelError, match="'eager' cannot run"):
            register_with_transformers(eager, link)
        with pytest.raises(SequenceParallelError, match="differs from the model's"):
            register_with_transformers(um.build(), link, "flash_attention_2")
        with pytest.raises(SequenceParallelError, match="divides 2"):
            register_with_transformers(um.build(heads=2, kv_heads=1), EchoLink(4, 0))
    finally:
        unregister_from_transformers()


def test_registering_replaces_the_implementation_and_unregistering_puts_it_back():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from shardwise.sequence_parallel import UlyssesAttention

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        assert register_with_transformers(um.build(), EchoLink(2, 0)) == "sdpa"
        assert register_with_transformers(um.build(), EchoLink(2, 0)) == "sdpa"  # again: still around the original
        wrapper = ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert isinstance(wrapper, UlyssesAttention) and wrapper.core is original
    finally:
        unregister_from_transformers()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original
    with pytest.raises(SequenceParallelError, match="a transformers model"):
        register_with_transformers(torch.nn.Linear(2, 2), EchoLink(2, 0))
