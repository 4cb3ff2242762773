"""`init_inference` in one process (tp 1): greedy generation and logits equal Hugging Face's for every tiny model,
loaded on meta from a safetensors folder or a DeepSpeed descriptor; a rank reads only its piece of a tensor;
refusals say what is wrong; int8 weights stay within half a scale step, take about half of bf16's memory and keep
a tied embedding and LM head shared."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import shardwise
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.safetensors_file import SafetensorsFile
from shardwise.config import ConfigError
from shardwise.inference import empty_weights, load_pretrained, weight_bytes
from shardwise.inference.empty_weights import meta_names
from shardwise.inference.quantize import QUANT, SCALE, quantize_rows
from shardwise.inference.sources import read_piece
from shardwise.protocols.tensor_shard import TensorShard
from shardwise.tensor_parallel import take
from tests import inference_models as im

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference_unit")
    return {kind: im.save_folder(im.build(kind), root / kind) for kind in im.KINDS}


@pytest.fixture(scope="module")
def oracle():
    """Per kind: Hugging Face's greedy output and logits, one process."""
    out = {}
    for kind in im.KINDS:
        model = im.build(kind)
        out[kind] = (im.oracle_generate(model, **im.greedy_kwargs()), im.oracle_logits(model))
    return out


def load(folder, **kwargs):
    return shardwise.init_inference(im.empty_model(folder), checkpoint=str(folder), **kwargs)


@pytest.mark.parametrize("kind", im.KINDS)
def test_meta_model_from_a_folder_generates_what_hugging_face_does(kind, folders, oracle):
    engine = load(folders[kind], max_out_tokens=64)
    assert meta_names(engine.module) == ([], [])
    assert torch.equal(engine.generate(**im.prompts(), **im.greedy_kwargs()), oracle[kind][0])
    im.assert_close_logits(im.engine_logits(engine), oracle[kind][1], label=kind)


def test_a_whole_model_needs_no_checkpoint(oracle):
    engine = shardwise.init_inference(im.build("llama"), tensor_parallel={"tp_size": 1}, dtype="fp32")
    assert engine.tp_size == 1 and engine.tp_rank == 0
    assert torch.equal(engine.generate(**im.prompts(), **im.greedy_kwargs()), oracle["llama"][0])


def test_load_pretrained_reads_the_folder(folders, oracle):
    engine = load_pretrained(folders["qwen2"], max_out_tokens=64)
    assert torch.equal(engine.generate(**im.prompts(), **im.greedy_kwargs()), oracle["qwen2"][0])


def _files(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


def test_deepspeed_descriptor_dict_and_json_file(folders, oracle, tmp_path):
    folder = folders["gpt2"]
    descriptor = {"type": "ds_model", "checkpoints": _files(folder), "version": 1.0}
    engines = [load_with(folder, checkpoint=descriptor, base_dir=str(folder))]
    path = tmp_path / "checkpoints.json"
    path.write_text(json.dumps(descriptor))
    engines.append(load_with(folder, checkpoint=str(path), base_dir=str(folder)))
    beside = folder / "ds_inference_checkpoint.json"  # no base_dir: the files are beside the JSON
    beside.write_text(json.dumps({**descriptor, "checkpoints": {"non_tp": _files(folder)}}))
    engines.append(load_with(folder, checkpoint=str(beside)))
    beside.unlink()
    for engine in engines:
        im.assert_close_logits(im.engine_logits(engine), oracle["gpt2"][1], label="descriptor")


def load_with(folder, **kwargs):
    return shardwise.init_inference(im.empty_model(folder), **kwargs)


def test_a_descriptor_naming_pickles_is_refused(folders):
    with pytest.raises(CheckpointError, match=r"\['/x/pytorch_model.bin'\] are not safetensors files; shardwise does "
                                              r"not unpickle weights \(it runs code\)\."):
        load_with(folders["llama"], checkpoint={"type": "ds_model", "checkpoints": ["pytorch_model.bin"]},
                  base_dir="/x")


@pytest.mark.parametrize(("dim", "blocks", "shape"), [(0, 1, (8, 6)), (1, 1, (8, 6)), (1, 3, (4, 12)),
                                                      (0, 3, (12, 4)), (1, 1, (3, 4, 5))])
def test_a_piece_is_read_without_reading_the_rest(dim, blocks, shape, tmp_path):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    save_file({"w": full}, tmp_path / "w.safetensors")
    file = SafetensorsFile(tmp_path / "w.safetensors")
    read = []
    original = file.read_range
    file.read_range = lambda key, lo, hi: read.append(hi - lo) or original(key, lo, hi)
    for rank in range(2):
        shard = TensorShard(dim, rank, 2, shape, blocks)
        assert torch.equal(read_piece(file, "w", shard), take(full, shard))
    assert sum(read) == full.numel(), f"read {sum(read)} elements for two halves of {full.numel()}"


def test_pickled_weights_are_refused(tmp_path):
    im.hf_config("llama").save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError) as caught:
        load(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path}: no *.safetensors files (and no model.safetensors.index.json). It has ['pytorch_model.bin']: "
        "pickled weights, which shardwise does not load (unpickling runs code); convert them with transformers' "
        "save_pretrained(safe_serialization=True).")


def _edited_folder(tmp_path, edit):
    model = im.build("llama")
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    edit(state)
    save_file(state, tmp_path / "model.safetensors")
    return tmp_path


def test_a_missing_weight_is_named(tmp_path):
    folder = _edited_folder(tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as caught:
        load(folder)
    assert str(caught.value).startswith("init_inference: the checkpoint has no weights for 1 of the model's "
                                        "parameters: ['model.layers.1.mlp.up_proj.weight'].")


def test_a_weight_of_the_wrong_shape_is_refused(tmp_path):
    folder = _edited_folder(tmp_path, lambda s: s.update({"model.norm.weight": torch.ones(32)}))
    with pytest.raises(CheckpointError) as caught:
        load(folder)
    assert str(caught.value) == (
        "init_inference: 'model.norm.weight' in the checkpoint gives shape (32,) for 'model.norm.weight', which has "
        "shape (64,) on this rank; the checkpoint is not this model's (check the model config).")


def test_a_meta_model_needs_a_checkpoint():
    with empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(im.hf_config("llama"))
    with pytest.raises(ConfigError, match=r"^init_inference: the model's parameters are on the meta device \(built "
                                          r"under empty_weights\(\) or torch.device\('meta'\)\) and no checkpoint= "
                                          r"was given to fill them; pass checkpoint="):
        shardwise.init_inference(model)


def test_tensor_parallel_needs_processes(monkeypatch):
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError) as caught:
        shardwise.init_inference(im.build("llama"), tensor_parallel={"tp_size": 2})
    assert str(caught.value) == ("init_inference: tensor_parallel.tp_size is 2, which needs 2 processes; start them "
                                 "with `shardwise --num_gpus 2 script.py` (or torchrun).")


def test_generation_longer_than_the_cache_is_refused():
    engine = shardwise.init_inference(im.build("llama"), max_out_tokens=16)
    with pytest.raises(ValueError) as caught:
        engine.generate(**im.prompts(), **im.greedy_kwargs(10))
    assert str(caught.value) == ("generate: 7 prompt tokens + 10 new ones = 17 exceeds max_out_tokens (16), the size "
                                 "of the key/value cache; pass a larger max_out_tokens to init_inference or ask for "
                                 "fewer tokens.")
    assert engine.generate(**im.prompts(), **im.greedy_kwargs(9)).shape == (2, 16)


def test_the_length_is_read_where_generate_reads_it():
    """No length anywhere: Hugging Face's default of 20 new tokens; a generation_config= counts as the keywords do."""
    engine = shardwise.init_inference(im.build("llama"), max_out_tokens=26)
    message = "generate: 7 prompt tokens + {} new ones = {} exceeds max_out_tokens (26)"
    with pytest.raises(ValueError, match=re.escape(message.format(20, 27))):
        engine.generate(**im.prompts(), pad_token_id=0)
    with pytest.raises(ValueError, match=re.escape(message.format(25, 32))):
        engine.generate(**im.prompts(), generation_config=transformers.GenerationConfig(max_new_tokens=25))
    config = transformers.GenerationConfig(max_new_tokens=19, min_new_tokens=19, pad_token_id=0)
    assert engine.generate(**im.prompts(), generation_config=config).shape == (2, 26)


@pytest.mark.parametrize("out_dim", [0, 1])
def test_int8_rows_are_within_half_a_scale_step(out_dim):
    weight = torch.randn(48, 40, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 40)
    weight[5 if out_dim == 0 else slice(None), slice(None) if out_dim == 0 else 5] = 0.0  # an all-zero channel
    q, scale = quantize_rows(weight, out_dim)
    assert q.dtype is torch.int8 and q.abs().max() == 127
    assert scale.shape == ((48, 1) if out_dim == 0 else (1, 40))
    error = (q.float() * scale - weight).abs()
    assert (error <= scale / 2 * (1 + 1e-6)).all(), f"worst {(error / scale).max().item()} scale steps"


def _int8(kind: str, **kwargs):
    return shardwise.init_inference(im.build(kind), **kwargs)


def test_int8_weights_take_about_half_of_bf16s_memory():
    bf16 = _int8("llama", dtype=torch.bfloat16)
    int8 = _int8("llama", dtype=torch.bfloat16, quant={"enabled": True})
    ratio = weight_bytes(int8.module) / weight_bytes(bf16.module)
    # measured 110208 / 213632 = 0.516 bytes: 1 byte a weight, one bf16 scale a row, the norms in bf16
    assert ratio <= 0.52, ratio
    quantized = [m for m in int8.module.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    assert len(quantized) == 2 * 7 + 2
    assert all("weight" not in m._parameters and getattr(m, QUANT).dtype is torch.int8 for m in quantized)


def test_a_tied_embedding_and_head_are_quantized_once():
    engine = _int8("qwen2", dtype=torch.int8)
    head, embed = engine.module.lm_head, engine.module.model.embed_tokens
    assert getattr(head, QUANT) is getattr(embed, QUANT) and getattr(head, SCALE) is getattr(embed, SCALE)
    untied = im.build("qwen2")
    whole = sum(p.numel() * 4 for p in untied.parameters())  # fp32, the tied weight counted once
    rows = sum(m.weight.shape[0] for m in untied.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
               if m is not untied.lm_head)
    others = sum(p.numel() * 4 for n, p in untied.named_parameters() if not n.endswith("proj.weight") and
                 "embed_tokens" not in n)
    assert weight_bytes(engine.module) == (whole - others) // 4 + rows * 4 + others


def test_int8_logits_stay_close_to_fp32(oracle):
    # worst logit errors measured on logits of scale 6.02: 0.225 with DeepSpeed's dtype=torch.int8 (computing in the
    # model's fp32), 0.326 with quant in bf16 (bf16 alone: 0.115). A random model with wide weights amplifies each
    # layer's error, so the bounds are a little above these, relative to the logits' scale.
    for kwargs, bound in (({"dtype": torch.int8}, 0.045), ({"dtype": torch.bfloat16, "quant": {"enabled": True}}, 0.065)):
        logits = im.engine_logits(_int8("llama", **kwargs)).float()
        error, scale = (logits - oracle["llama"][1]).abs().max().item(), oracle["llama"][1].abs().max().item()
        assert 0 < error <= bound * scale, (kwargs, error, scale)
