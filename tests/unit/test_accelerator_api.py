"""shardwise.accelerator.get_accelerator(): DeepSpeed's accelerator API answered for a CPU machine, as
DeepSpeed's CPU accelerator answers (the values below are what DeepSpeed 0.19.8 returns with
DS_ACCELERATOR=cpu; tests/distributed/test_deepspeed_parity.py checks them against it when it is installed)."""

from __future__ import annotations

import os

import pytest
import torch

from shardwise.accelerator import get_accelerator


@pytest.fixture
def acc():
    if torch.cuda.is_available():
        pytest.skip("these are the CPU answers; tests/gpu covers CUDA")
    return get_accelerator()


def test_one_object_per_process(acc):
    assert get_accelerator() is acc


def test_device_names_on_cpu(acc, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.current_device() == 1 and acc.device_count() == 3
    assert torch.device(acc.device_name(), 1).type == "cpu"  # DeepSpeed-Chat builds its device this way
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.is_bf16_supported() and acc.is_fp16_supported() and acc.is_synchronized_device()
    assert acc.on_accelerator(torch.zeros(1)) and acc.Stream is None and acc.Event is None


def test_manual_seed_all_seeds_torch_on_cpu(acc):
    acc.manual_seed_all(7)
    first = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(4))
    state = acc.get_rng_state()
    a = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))


def test_memory_figures_are_the_resident_set(acc):
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    allocated = acc.memory_allocated()
    assert 0.5 * rss < allocated < 2 * rss
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert acc.max_memory_allocated() >= acc.memory_allocated() >= allocated + 32 * 2**20
    del big
    assert acc.total_memory() > acc.available_memory() > 0
    assert acc.memory_stats()["allocated_bytes.all.peak"] >= acc.memory_stats()["allocated_bytes.all.current"]


def test_no_op_streams_and_ranges(acc):
    with acc.stream(None):
        acc.range_push("x")
        acc.range_pop()
    acc.synchronize()
    acc.empty_cache()
    t = torch.zeros(2)
    assert acc.pin_memory(t) is t
    assert acc.create_op_builder("CPUAdamBuilder") is None
    assert acc.lazy_call(lambda: 5) == 5
