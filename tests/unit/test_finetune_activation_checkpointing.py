"""The `activation_checkpointing` config section and `shardwise.runtime.activation_checkpointing`
(DeepSpeed's `deepspeed.checkpointing` API), in one process."""

from __future__ import annotations

import logging

import pytest
import torch

from shardwise.config import ConfigError, parse_config
from shardwise.runtime import activation_checkpointing as ac

BASE = {"train_micro_batch_size_per_gpu": 1}


def test_section_parses_deepspeed_keys():
    cfg = parse_config({**BASE, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
        "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": False}})
    section = cfg.activation_checkpointing
    assert section.cpu_checkpointing and section.partition_activations and section.number_checkpoints == 4
    assert parse_config(BASE).activation_checkpointing == ac.ActivationCheckpointingConfig()


def test_section_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"activation_checkpointing.cpu_checkpoint: unknown key. Did you mean 'cpu_checkpointing'"):
        parse_config({**BASE, "activation_checkpointing": {"cpu_checkpoint": True}})
    with pytest.raises(ConfigError, match=r"activation_checkpointing.number_checkpoints"):
        parse_config({**BASE, "activation_checkpointing": {"number_checkpoints": 0}})


def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


@pytest.mark.parametrize("settings", [{}, {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True,
                                           "profile": True, "partition_activations": True}])
def test_checkpoint_recomputes_and_matches_plain_backward(settings, caplog):
    block, x = _block(), torch.randn(4, 8, requires_grad=True)
    block(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    calls = []
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    checkpointer = ac.configure(config=ac.ActivationCheckpointingConfig(**settings))
    with caplog.at_level(logging.INFO, logger="shardwise.runtime.activation_checkpointing"):
        ac.checkpoint(block, x).pow(2).sum().backward()
    assert len(calls) == 2  # the forward, and its recomputation in backward
    for got, want in zip([p.grad for p in block.parameters()] + [x.grad], expected):
        torch.testing.assert_close(got, want)
    assert checkpointer.calls == 1 and ac.is_configured()
    assert ("activation checkpoint 1: forward" in caplog.text) == bool(settings.get("profile"))


def test_cpu_checkpointing_keeps_the_inputs_through_save_on_cpu(monkeypatch):
    entered = []
    original = torch.autograd.graph.save_on_cpu

    class Spy(original):
        def __enter__(self):
            entered.append(True)
            return super().__enter__()

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Spy)
    x = torch.randn(2, 8, requires_grad=True)
    ac.Checkpointer(ac.ActivationCheckpointingConfig(cpu_checkpointing=True))(_block(), x).sum().backward()
    ac.Checkpointer(ac.ActivationCheckpointingConfig())(_block(), x).sum().backward()
    assert entered == [True]


def test_configure_takes_deepspeed_spellings_and_whole_configs(caplog):
    checkpointer = ac.configure(None, checkpoint_in_cpu=True, synchronize=True)
    assert checkpointer.config.cpu_checkpointing and checkpointer.config.synchronize_checkpoint_boundary
    checkpointer = ac.configure(deepspeed_config={**BASE, "activation_checkpointing": {"profile": True}})
    assert checkpointer.config.profile and not checkpointer.config.cpu_checkpointing
    with caplog.at_level(logging.WARNING):
        ac.configure(num_checkpoints=4)
    assert "not acted on" in caplog.text
    with pytest.raises(ValueError, match="model-parallel units are not supported"):
        ac.configure(object())
    ac.reset()


def test_hf_layers_use_the_checkpointer():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    checkpointer = ac.Checkpointer()
    ac.use_hf_layers(model, checkpointer)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert checkpointer.calls == 2  # one per decoder layer
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=lambda m: f"{name}: {m}")
    with pytest.raises(TypeError, match="not a Hugging Face model"):
        ac.use_hf_layers(torch.nn.Linear(2, 2), checkpointer)
