"""What TRL needs of the engine (tests/compat/test_trl.py runs TRL itself), at world size 2:

- `initialize` with no optimizer (none passed, no "optimizer" section) builds DeepSpeed's forward-only engine, as
  TRL's `prepare_deepspeed` does for a reference model: stage 3 partitions and gathers for each forward, stage 0
  holds the whole model, a frozen model is accepted; backward and step refuse; stages 1-2 need an optimizer.
- a custom autograd.Function that saved a ZeRO-3 parameter gets that very parameter back in its backward, with
  its `ds_status` (TRL's fused log-prob loss gathers the saved `lm_head.weight` there), on the first forward too,
  which the engine measures for the out-of-memory explainer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from tests.harness import run_distributed
from tests.parity import ds_config, make_model, micro_batch, param_groups


def _no_optimizer(stage: int, **zero) -> dict:
    config = ds_config(2, 1, zero_optimization={"stage": stage, **zero})
    config.pop("optimizer")
    return config


def _refusal(call) -> str | None:
    try:
        call()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def _forward_only_engines():
    shardwise.init_distributed()
    tokens, labels = micro_batch(0, 0, dist.get_rank(), 2, 1, 2)
    out = {}
    for stage, frozen in ((3, False), (0, True)):
        model = make_model()
        model.requires_grad_(not frozen)
        engine, optimizer, _, scheduler = shardwise.initialize(
            model=model, config=_no_optimizer(stage, stage3_param_persistence_threshold=0))
        engine.eval()
        with torch.no_grad():
            loss = engine(tokens, labels).item()
        out[stage] = {"loss": loss, "optimizer": optimizer, "scheduler": scheduler,
                      "partitioned": all(hasattr(p, "ds_id") for p in engine.module.parameters()),
                      "backward": _refusal(lambda: engine.backward(torch.ones((), requires_grad=True))),
                      "step": _refusal(engine.step)}
    with torch.no_grad():
        out["plain"] = make_model()(tokens, labels).item()
    model = make_model()
    out["stage2"] = _refusal(lambda: shardwise.initialize(model=model, config=_no_optimizer(2)))
    out["scheduler"] = _refusal(lambda: shardwise.initialize(model=model, config=_no_optimizer(3),
                                                            lr_scheduler=lambda opt: None))
    return out


def test_no_optimizer_builds_a_forward_only_engine():
    for out in run_distributed(_forward_only_engines, 2):
        for stage in (3, 0):
            assert out[stage]["loss"] == pytest.approx(out["plain"], rel=1e-6)
            assert out[stage]["optimizer"] is None and out[stage]["scheduler"] is None
            for call in ("backward", "step"):
                assert "built without an optimizer" in out[stage][call], out[stage][call]
        assert out[3]["partitioned"] and not out[0]["partitioned"]
        assert "ZeRO stage 2 needs one" in out["stage2"]
        assert "lr_scheduler: given without an optimizer" in out["scheduler"]


class _Head(torch.autograd.Function):
    """Logits through a weight the function reads itself, as TRL's chunked log-prob loss does: the weight is
    gathered only where it is not whole (`ds_status`), in forward and again in backward."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return hidden @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        hidden, weight = ctx.saved_tensors
        _Head.seen.append(isinstance(weight, torch.nn.Parameter))
        gather = weight.ds_status != ZeroParamStatus.AVAILABLE  # AttributeError on a stand-in for the parameter
        with deepspeed.zero.GatheredParameters([weight]) if gather else torch.no_grad():
            return grad @ weight, grad.t() @ hidden


class _FusedHead(torch.nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 64, bias=False)
        self.fused = fused

    def forward(self, x, y):
        h = torch.tanh(self.body(x))
        logits = _Head.apply(h, self.head.weight) if self.fused else self.head(h)
        return F.cross_entropy(logits, y)


def _train_with_head(fused: bool):
    import deepspeed

    model = _FusedHead(fused)
    config = ds_config(2, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        loss = engine(torch.randn(4, 8, generator=g), torch.randint(0, 64, (4,), generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, _Head.seen


def test_a_saved_partitioned_parameter_comes_back_to_backward():
    for (fused, seen), (plain, _) in zip(run_distributed(_train_with_head, 2, True),
                                          run_distributed(_train_with_head, 2, False)):
        assert seen == [True, True, True]
        assert fused == pytest.approx(plain, rel=1e-6)
