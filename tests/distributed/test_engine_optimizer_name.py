"""`engine.optimizer_name()` (bing_bert's deepspeed_train.py picks its LAMB path by it) against DeepSpeed 0.19.8's
answers for the same configs, measured in .dsvenv: its own optimizer names lower-cased, torch.optim names as
written, a client optimizer's class name (a factory's own type: 'function')."""

from __future__ import annotations

import torch

import shardwise
from tests.harness import run_distributed
from tests.parity import make_model


def _names():
    out = {}
    for written in ["Adam", "adam", "AdamW", "SGD", "Adagrad", "RMSprop"]:
        model = make_model()
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": written, "params": {"lr": 0.1}}}
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=config)
        out[written] = engine.optimizer_name()
    adam = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    for label, make in [("client-instance", lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
                        ("client-callable", lambda m: (lambda ps: torch.optim.SGD(ps, lr=0.1)))]:
        model = make_model()
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=adam,
                                          optimizer=make(model))
        out[label] = engine.optimizer_name()
    return out


def test_optimizer_name_as_deepspeed():
    assert run_distributed(_names, 1)[0] == {
        "Adam": "adam", "adam": "adam", "AdamW": "adamw", "SGD": "SGD", "Adagrad": "adagrad", "RMSprop": "RMSprop",
        "client-instance": "SGD", "client-callable": "function"}
