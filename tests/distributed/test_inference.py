"""`init_inference` over a tensor-parallel group against one-process Hugging Face: every tiny model loaded on meta
from a sharded safetensors folder at tp 2 (LLaMA also at tp 4, and as two tp-2 replicas of a world of 4) greedily
generates exactly HF's tokens, with HF's logits to 1e-5; sampling draws HF's tokens for rank 0's seed on every rank;
each rank reads exactly its own piece of every weight; int8 weights at tp 2 decode as they do at tp 1; DeepSpeed's
`injection_policy` splits as the built-in plan does; and inputs or weights that differ between ranks are refused on
every rank, not left to hang or to compute garbage.

Each spawned group sweeps its sub-cases (start-up is the cost); the tests read its results.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from shardwise.checkpoint.safetensors_file import SafetensorsFile
from tests import inference_models as im
from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")

SEED = 1234
"""Rank r seeds SEED + 7 r before sampling: the engine gives every rank rank 0's random state."""


def _served(folder, tp: int, **kwargs):
    import shardwise

    return shardwise.init_inference(im.empty_model(folder), tensor_parallel={"tp_size": tp}, checkpoint=str(folder),
                                    max_out_tokens=64, **kwargs)


def _outputs(engine) -> dict:
    torch.manual_seed(SEED + 7 * int(os.environ["RANK"]))
    sampled = engine.generate(**im.prompts(), **im.sample_kwargs())
    return {"greedy": engine.generate(**im.prompts(), **im.greedy_kwargs()), "logits": im.engine_logits(engine),
            "sampled": sampled}


@contextlib.contextmanager
def _reads_counted() -> Iterator[dict[str, int]]:
    """Bytes read from safetensors files per tensor, within the block."""
    counts: dict[str, int] = {}

    def counted(read):
        def wrapper(self, key, *args):
            tensor = read(self, key, *args)
            counts[key] = counts.get(key, 0) + tensor.numel() * tensor.element_size()
            return tensor
        return wrapper

    with mock.patch.object(SafetensorsFile, "read_range", counted(SafetensorsFile.read_range)), \
            mock.patch.object(SafetensorsFile, "get_tensor", counted(SafetensorsFile.get_tensor)):
        yield counts


def _attempt(case):
    """A sub-case's result, or what it raised (raised alike on every rank: the group stays in step), so that one
    broken case fails its own test rather than the whole sweep."""
    try:
        return case()
    except Exception as e:  # noqa: BLE001 - reported by the test that reads the case
        return {"error": f"{type(e).__name__}: {e}"}


def _sweep_tp2(folders: dict) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardwise.inference.empty_weights import meta_names

    def plain(folder):
        with _reads_counted() as counts:
            engine = _served(folder, 2)
        return {**_outputs(engine), "read": dict(counts), "meta": meta_names(engine.module),
                "local": {n: p.numel() * p.element_size() for n, p in engine.module.named_parameters()},
                "shapes": {n: tuple(p.shape) for n, p in engine.module.named_parameters()}}

    def int8(folder):
        return {"greedy": _served(folder, 2, dtype=torch.int8).generate(**im.prompts(), **im.greedy_kwargs())}

    def policy():
        rows = {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}
        engine = _served(folders["llama"], 2, injection_policy=rows)
        return {"greedy": engine.generate(**im.prompts(), **im.greedy_kwargs()),
                "split": {n: tuple(p.shape) for n, p in engine.module.named_parameters()}}

    def generation_config():
        torch.manual_seed(SEED + 7 * int(os.environ["RANK"]))
        config = transformers.GenerationConfig(**im.sample_kwargs())
        return {"sampled": _served(folders["llama"], 2).generate(**im.prompts(), generation_config=config)}

    out = {}
    for kind, folder in folders.items():
        out[kind] = _attempt(functools.partial(plain, folder))
        out[f"{kind} int8"] = _attempt(functools.partial(int8, folder))
    out["policy"], out["generation_config"] = _attempt(policy), _attempt(generation_config)
    return out


def _case(result: dict, name: str) -> dict:
    assert "error" not in result[name], f"{name}: {result[name]['error']}"
    return result[name]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference_tp")
    folders, oracle = {}, {}
    for kind in im.KINDS:
        model = im.build(kind)
        folders[kind] = im.save_folder(model, root / kind)
        torch.manual_seed(SEED)
        oracle[kind] = {"greedy": im.oracle_generate(model, **im.greedy_kwargs()), "logits": im.oracle_logits(model),
                        "sampled": im.oracle_generate(model, **im.sample_kwargs()),
                        "state": {k: tuple(v.shape) for k, v in model.state_dict().items()}}
    return folders, oracle


@pytest.fixture(scope="module")
def tp2(built):
    return run_distributed(_sweep_tp2, 2, built[0], timeout=180)


@pytest.mark.parametrize("kind", im.KINDS)
def test_tp2_generates_and_scores_as_hugging_face(kind, built, tp2):
    oracle = built[1][kind]
    for rank, result in enumerate(tp2):
        got = _case(result, kind)
        assert torch.equal(got["greedy"], oracle["greedy"]), (kind, rank, got["greedy"], oracle["greedy"])
        im.assert_close_logits(got["logits"], oracle["logits"], label=f"{kind} rank {rank}")
        assert got["meta"] == ([], []), got["meta"]


@pytest.mark.parametrize("kind", im.KINDS)
def test_sampling_draws_rank_0s_tokens_on_every_rank_as_one_process_does(kind, built, tp2):
    """Each rank seeded differently: the engine gives the group rank 0's random state, and the tensor-parallel
    model consumes it as the one-process model does (one multinomial draw per step)."""
    for rank, result in enumerate(tp2):
        assert torch.equal(_case(result, kind)["sampled"], built[1][kind]["sampled"]), (kind, rank)


def test_sampling_asked_for_through_a_generation_config_is_shared_too(built, tp2):
    sampled = [_case(result, "generation_config")["sampled"] for result in tp2]
    assert torch.equal(sampled[0], sampled[1]), sampled
    assert torch.equal(sampled[0], built[1]["llama"]["sampled"])


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_each_rank_reads_exactly_its_piece_of_every_weight(kind, built, tp2):
    """LLaMA: row and column splits; GPT-2: Conv1D (weights [in, out]) and the fused q/k/v split as 3 blocks,
    learned positions and norms whole; Qwen2: embedding tied to the head (read once)."""
    folder = built[0][kind]
    files = [SafetensorsFile(p) for p in folder.glob("*.safetensors")]
    whole = sum(f.numel(k) * 4 for f in files for k in f.keys())
    for rank, result in enumerate(tp2):
        got = _case(result, kind)
        assert got["read"] == got["local"], (rank, {k: (v, got["local"].get(k)) for k, v in got["read"].items()
                                                    if v != got["local"].get(k)})
        replicated = sum(b for n, b in got["local"].items() if got["shapes"][n] == built[1][kind]["state"][n])
        assert sum(got["read"].values()) <= whole / 2 + replicated + 1024, (rank, sum(got["read"].values()), whole)


def test_int8_at_tp2_decodes_as_int8_at_tp1(built, tp2):
    """A row-split weight's scale is its whole row's, so tp 2 dequantizes to tp 1's weights."""
    import shardwise

    for kind in im.KINDS:
        one = shardwise.init_inference(im.empty_model(built[0][kind]), checkpoint=str(built[0][kind]), dtype=torch.int8)
        expected = one.generate(**im.prompts(), **im.greedy_kwargs())
        for rank, result in enumerate(tp2):
            assert torch.equal(_case(result, f"{kind} int8")["greedy"], expected), (kind, rank)


def test_injection_policy_splits_as_the_built_in_plan(built, tp2):
    for rank, result in enumerate(tp2):
        case = _case(result, "policy")
        assert torch.equal(case["greedy"], built[1]["llama"]["greedy"]), rank
        split = case["split"]
        assert split["model.layers.0.self_attn.o_proj.weight"] == (64, 32)  # row-parallel: input features halved
        assert split["model.layers.1.mlp.gate_proj.weight"] == (64, 64)  # column-parallel: output features halved
        assert split["model.embed_tokens.weight"] == (im.VOCAB, 64)  # not named by the policy: whole


def _sweep_world4(folder) -> dict:
    import shardwise
    from shardwise.config import ConfigError

    out = {"tp4": _outputs(_served(folder, 4)), "tp2": _outputs(_served(folder, 2))}
    with pytest.raises(ConfigError) as caught:
        _served(folder, 3)
    out["tp3"] = str(caught.value)
    out["replica"] = shardwise.init_inference(im.build("llama"), tensor_parallel={"tp_size": 2}).tp_rank
    return out


def test_world_of_four_tp4_and_two_tp2_replicas(built):
    results = run_distributed(_sweep_world4, 4, built[0]["llama"], timeout=180)
    oracle = built[1]["llama"]
    for rank, result in enumerate(results):
        for tp in ("tp4", "tp2"):
            assert torch.equal(result[tp]["greedy"], oracle["greedy"]), (tp, rank)
            assert torch.equal(result[tp]["sampled"], oracle["sampled"]) or tp == "tp2" and rank >= 2, (tp, rank)
            im.assert_close_logits(result[tp]["logits"], oracle["logits"], label=f"{tp} rank {rank}")
        assert result["tp3"] == ("init_inference: tensor_parallel.tp_size (3) must divide the number of processes "
                                 "(4); each group of tp_size ranks serves one replica.")
        assert result["replica"] == rank % 2
    # the second replica (ranks 2, 3) shares its own rank 0's (global rank 2's) random state
    model = im.build("llama")
    torch.manual_seed(SEED + 14)
    assert torch.equal(results[2]["tp2"]["sampled"], im.oracle_generate(model, **im.sample_kwargs()))


def _refusals(folder) -> dict:
    import shardwise

    rank = int(os.environ["RANK"])
    out = {}
    with pytest.raises(ValueError) as caught:
        shardwise.init_inference(im.build("llama", seed=rank), tensor_parallel={"tp_size": 2})
    out["weights"] = str(caught.value)
    # different random weights are fine when a checkpoint replaces them all
    engine = shardwise.init_inference(im.build("llama", seed=rank), tensor_parallel={"tp_size": 2},
                                      checkpoint=str(folder))
    out["overwritten"] = engine.generate(**im.prompts(), **im.greedy_kwargs())
    ids = im.prompts()["input_ids"] + rank
    for call in ("generate", "forward"):
        with pytest.raises(ValueError) as caught:
            engine.generate(input_ids=ids, max_new_tokens=2) if call == "generate" else engine(ids)
        out[call] = str(caught.value)
    with pytest.raises(ValueError) as caught:  # same ids, different generation arguments
        engine.generate(**im.prompts(), **im.greedy_kwargs(3 + rank))
    out["arguments"] = str(caught.value)
    out["after"] = engine(**im.prompts()).logits  # the group still works after refusing
    return out


def test_what_differs_between_ranks_is_refused_on_every_rank(built):
    results = run_distributed(_refusals, 2, built[0]["llama"], timeout=120)
    different_inputs = ("inference: the 2 tensor-parallel ranks were called with different inputs; every rank of the "
                        "group must pass the same input_ids, attention_mask and generation arguments (broadcast them "
                        "from one rank).")
    for result in results:
        assert result["weights"] == (
            "init_inference: the tensor-parallel ranks hold different weights (the model was built with different "
            "random values on each); load it from the same files on every rank, seed every rank alike, or pass "
            "checkpoint= so every rank reads its piece of the same weights.")
        assert torch.equal(result["overwritten"], built[1]["llama"]["greedy"])
        assert result["generate"] == result["forward"] == result["arguments"] == different_inputs
        im.assert_close_logits(result["after"], built[1]["llama"]["logits"])
