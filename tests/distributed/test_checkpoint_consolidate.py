"""Consolidation: exact full weights, Hugging Face loadable, streaming memory; the inspect table."""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.checkpoint import cli
from shardwise.checkpoint.consolidate import consolidate
from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def _train_and_save(root):
    model = _llama()
    engine, *_ = shardwise.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(root)
    masters = {}
    for unit in engine.strategy.trainable:  # the fp32 truth, gathered for comparison
        full = torch.empty(unit.numel, dtype=torch.float32)
        dist.all_gather_into_tensor(full, unit.master.detach())
        for slot, name in zip(unit.layout.slots, unit.names):
            masters[name] = full[slot.offset : slot.offset + slot.numel].view(unit.shapes[unit.names.index(name)]).clone()
    return masters


def test_to_fp32_equals_trained_masters_and_loads_with_from_pretrained(tmp_path):
    masters = run_distributed(_train_and_save, 2, str(tmp_path / "ckpt"))[0]
    out = tmp_path / "hf"
    assert cli.main(["to-fp32", str(tmp_path / "ckpt"), str(out), "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded by size
    _llama().config.save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    state = loaded.state_dict()
    for name, value in masters.items():
        assert torch.equal(state[name], value), name


def test_inspect_prints_the_manifest(tmp_path, capsys):
    run_distributed(_train_and_save, 2, str(tmp_path))
    assert cli.main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "world size 2, ZeRO stage 3, step 3" in text
    assert "model.embed_tokens.weight" in text and "rank0[0:1024]" in text and "rank1[1024:2048]" in text


def _save_big(root):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 2048, bias=False) for _ in range(12)])
    engine, *_ = shardwise.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2}})
    engine.save_checkpoint(root)


def _status_bytes(key: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key))
    return int(line.split()[1]) * 1024


def _measure(root, out, shard_bytes, queue):
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # return freed blocks to the OS at once: RSS tracks live bytes
    libc.mallopt(-1, 64 * 1024)
    # Once before measuring: one-time set-up (lazily loaded library pages, allocator state) is not what streaming
    # costs, and would be the same for a checkpoint of any size.
    consolidate(root, f"{out}-warm", max_shard_bytes=shard_bytes)
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak RSS (VmHWM) starts again from the current RSS
    before = _status_bytes("VmRSS:")
    consolidate(root, out, max_shard_bytes=shard_bytes)
    queue.put(_status_bytes("VmHWM:") - before)


def test_consolidation_peak_memory_is_about_two_tensors(tmp_path):
    """The README's claim for `to-fp32`: memory of about two tensors (the one read, and the copy being written),
    not the model's, whatever the shard size."""
    run_distributed(_save_big, 2, str(tmp_path / "ckpt"), timeout=240)
    total, tensor = 96 * 2**20, 8 * 2**20  # 96 MiB of weights in twelve 8 MiB tensors, each split over 2 rank files
    for shard in (24 * 2**20, 2**30):  # 4 output files of 3 tensors; one file of all 12
        queue = mp.get_context("fork").Queue()
        proc = mp.get_context("fork").Process(target=_measure, args=(str(tmp_path / "ckpt"), str(tmp_path / f"out{shard}"),
                                                                     shard, queue))
        proc.start()
        grown = queue.get(timeout=120)
        proc.join()
        # Two tensors, and 2 MiB for everything else (headers, the manifest, Python objects): 18 MiB, 19% of the model.
        assert grown <= 2 * tensor + 2 * 2**20, f"{shard}: peak grew {grown / 2**20:.1f} MiB for {total / 2**20:.0f} MiB"
