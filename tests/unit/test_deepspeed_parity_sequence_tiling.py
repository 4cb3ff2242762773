"""shardwise's `TiledMLP`, `TiledFusedLogitsLoss` and `sequence_tiled_compute` against DeepSpeed 0.19.8's own
(`deepspeed.runtime.sequence_parallel.ulysses_sp`), called the same way on the same inputs, when DeepSpeed is
installed: outputs and every gradient (the input's and the parameters') to 1e-6, fp32, on the CPU.

DeepSpeed is a reference here, never a dependency: without it these tests skip (tests/reference.py).
`make test-deepspeed` runs them against deepspeed==0.19.8, as .ci/run does. The cases are those where
DeepSpeed's own results are right (tiles that torch.chunk makes as many as asked; a trainable input); where
shardwise departs from it (tiled.py, tiled_loss.py) test_sequence_tiling.py checks against untiled torch.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.reference import real_deepspeed

os.environ.setdefault("DS_ACCELERATOR", "cpu")
real_deepspeed()  # skips in shardwise's own venv; `make test-deepspeed` runs this module against DeepSpeed
import deepspeed.runtime.sequence_parallel.ulysses_sp as ds_sp  # noqa: E402

from shardwise.sequence_parallel import tiled, tiled_loss  # noqa: E402
from tests.unit.test_sequence_tiling import HIDDEN, llama_mlp  # noqa: E402

TOL = dict(rtol=1e-6, atol=1e-6)
VOCAB = 64


def mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def run(module: torch.nn.Module, inputs: list[torch.Tensor], call) -> list[torch.Tensor]:
    """The output of `call()` after its backward (with an upstream gradient for non-scalars), then the
    gradients of `inputs` and of `module`'s parameters; all gradients reset."""
    for t in inputs:
        t.grad = None
    module.zero_grad(set_to_none=True)
    out = call()
    upstream = torch.ones(()) if out.dim() == 0 else torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    out.backward(upstream)
    got = [out.detach()] + [t.grad for t in inputs] + [p.grad for p in module.parameters()]
    assert all(g is not None for g in got), "a gradient is missing"
    return got


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("shape,shards", [((1, 12, HIDDEN), 3), ((2, 11, HIDDEN), 4), ((1, 8, HIDDEN), 1)])
def test_tiled_mlp_matches_deepspeed(shape, shards) -> None:
    mlp = llama_mlp()
    x = torch.randn(*shape, requires_grad=True)
    params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
    want = run(mlp, [x], lambda: ds_sp.TiledMLP.apply(mlp_forward, mlp, x, shards, params))
    got = run(mlp, [x], lambda: tiled.TiledMLP.apply(mlp_forward, mlp, x, shards, params))
    assert_same(got, want)
    assert_same(got, run(mlp, [x], lambda: mlp(x)))


def loss_fn(self: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


def sum_loss_fn(self: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(self(x), torch.where(mask, y, -100), reduction="sum")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_fused_logits_loss_matches_deepspeed(reduction: str) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    x = torch.randn(2, 12, HIDDEN, requires_grad=True)
    y = torch.randint(0, VOCAB, (2, 12))
    y[0, :3] = -100  # fewer than a tile of 4 at 6 shards: DeepSpeed's per-tile mean of nothing is NaN
    mask = None
    fn = loss_fn
    if reduction == "sum":
        mask, fn = torch.rand(2, 12) > 0.3, sum_loss_fn
    for shards in (1, 4, 6):
        want = run(head, [x], lambda: ds_sp.TiledFusedLogitsLoss.apply(fn, head, x, y, mask, shards, [head.weight],
                                                                       reduction))
        got = run(head, [x], lambda: tiled_loss.TiledFusedLogitsLoss.apply(fn, head, x, y, mask, shards,
                                                                           [head.weight], reduction))
        assert_same(got, want)


@pytest.mark.parametrize("batch", [1, 2])
def test_sequence_tiled_compute_matches_deepspeed(batch: int) -> None:
    """DeepSpeed's two shapes of use: an output concatenated along the sequence (no reduction), and one value
    per tile (dimension 0), averaged."""
    mlp = llama_mlp()
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    x = torch.randn(batch, 12, HIDDEN, requires_grad=True)
    y = torch.randint(0, VOCAB, (batch, 12))
    params = list(mlp.parameters())

    def along_sequence(api):
        return lambda: api.sequence_tiled_compute(lambda hidden_states, scale: mlp(hidden_states) * scale, 12, 3,
                                                  {"hidden_states": x}, {"scale": 0.5}, "hidden_states", params,
                                                  output_unshard_dimension=1, output_reduction=None)

    assert_same(run(mlp, [x], along_sequence(tiled)), run(mlp, [x], along_sequence(ds_sp)))

    def per_tile(api):
        return lambda: api.sequence_tiled_compute(lambda x, y: loss_fn(head, x, y), 12, 4, {"x": x, "y": y}, {},
                                                  "x", [head.weight], output_unshard_dimension=0,
                                                  output_reduction="mean")

    assert_same(run(head, [x], per_tile(tiled)), run(head, [x], per_tile(ds_sp)))
