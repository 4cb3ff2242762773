"""ALST's memory tricks, each on its own (no sequence parallelism), in one process, fp32: the tiled MLP
(shardwise.sequence_parallel.tiled), the tiled logits + loss (tiled_loss.py), and Hugging Face gradient
checkpointing with its kept inputs in host memory (offload.py).

Tiling changes no number beyond summation order, so outputs and gradients are compared with the untiled run to
1e-6. What each trick saves is measured here on the CPU: the bytes of activations saved for backward that are
alive at once (saved-tensor hooks; the parameters, resident anyway, are not counted), and the largest tensor any
operation makes, forward and backward (a dispatch mode): the tiled loss must never make a [tokens, vocab] one.
The DeepSpeed names' parity with DeepSpeed 0.19.8 itself is test_deepspeed_parity_sequence_tiling.py's.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardwise.sequence_parallel import offload
from shardwise.sequence_parallel.tiled import (TiledMLP, sequence_tiled_compute, tile_bounds, tile_forward,
                                               tiled_mlp)
from shardwise.sequence_parallel.tiled_loss import TiledFusedLogitsLoss, tiled_cross_entropy

TOL = dict(rtol=1e-6, atol=1e-6)
HIDDEN, INTERMEDIATE, VOCAB = 16, 40, 96


def llama_mlp() -> torch.nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=4,
                                num_key_value_heads=4))


def grads_of(module: torch.nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor | None]:
    out = [t.grad for t in tensors] + [p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    for t in tensors:
        t.grad = None
    return out


def assert_same(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
    assert [g is None for g in got] == [w is None for w in want]
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g, w, **TOL)


def test_tile_bounds_cover_the_sequence_without_empty_tiles() -> None:
    assert tile_bounds(11, 4) == [(0, 3), (3, 6), (6, 9), (9, 11)]
    assert tile_bounds(6, 4) == [(0, 2), (2, 4), (4, 6)]  # as torch.chunk: fewer tiles rather than empty ones
    assert tile_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="tiles: a positive number of tiles is required; got 0"):
        tile_bounds(4, 0)


TILED_MLPS: dict[str, Callable[[torch.nn.Module, torch.Tensor, int], torch.Tensor]] = {
    "tiled_mlp": lambda mlp, x, tiles: tiled_mlp(mlp, x, tiles),
    "tile_forward": lambda mlp, x, tiles: tile_forward(mlp, tiles)(x),
    "TiledMLP.apply": lambda mlp, x, tiles: TiledMLP.apply(lambda self, h: self.forward(h), mlp, x, tiles,
                                                           [mlp.gate_proj.weight]),
}


@pytest.mark.parametrize("api", TILED_MLPS)
@pytest.mark.parametrize("tiles", [1, 3, 4, 11, 20])  # 3, 4: uneven tiles of 11; 20: more tiles than positions
def test_tiled_mlp_matches_the_untiled_mlp(api: str, tiles: int) -> None:
    mlp = llama_mlp()
    x = torch.randn(2, 11, HIDDEN, requires_grad=True)
    upstream = torch.randn(2, 11, HIDDEN)
    want = mlp(x)
    want.backward(upstream)
    want_grads = grads_of(mlp, x)
    calls = []
    mlp.down_proj.register_forward_pre_hook(lambda *_: calls.append(1))
    got = TILED_MLPS[api](mlp, x, tiles)
    forward_calls = len(calls)
    got.backward(upstream)
    torch.testing.assert_close(got, want, **TOL)
    assert_same(grads_of(mlp, x), want_grads)
    # Tiled for real: one call per tile in forward, each recomputed once in backward.
    assert forward_calls == len(tile_bounds(11, tiles)) and len(calls) == 2 * forward_calls


def test_tiled_mlp_frozen_params_and_an_input_without_grad() -> None:
    """LoRA's case: frozen base weights get no gradient, and the trainable ones get theirs even though the
    tiled input itself needs none (a frozen embedding below); each gradient arrives once (one accumulation, so a
    reducer's hook fires once per backward)."""
    mlp = llama_mlp()
    for p in (mlp.gate_proj.weight, mlp.up_proj.weight):
        p.requires_grad_(False)
    x = torch.randn(1, 10, HIDDEN)
    mlp(x).square().sum().backward()
    want = grads_of(mlp)
    arrivals = []
    mlp.down_proj.weight.register_post_accumulate_grad_hook(lambda p: arrivals.append(p.grad.clone()))
    tiled_mlp(mlp, x, 4).square().sum().backward()
    got = grads_of(mlp)
    assert got[0] is None and got[1] is None
    assert_same(got, want)
    assert len(arrivals) == 1
    torch.testing.assert_close(arrivals[0], want[2], **TOL)


def test_a_trainable_tensor_the_function_closes_over_gets_its_gradient() -> None:
    """A tensor not handed over (a closure's) still gets its gradient, summed over the tiles, once."""
    torch.manual_seed(0)
    scale = torch.randn(HIDDEN, requires_grad=True)
    x = torch.randn(2, 9, HIDDEN, requires_grad=True)
    (torch.tanh(x * scale) * x).sum().backward()
    want = [x.grad.clone(), scale.grad.clone()]
    x.grad, scale.grad = None, None
    arrivals = []
    scale.register_post_accumulate_grad_hook(lambda p: arrivals.append(1))
    tiled_mlp(lambda h: torch.tanh(h * scale) * h, x, 4).sum().backward()
    assert_same([x.grad, scale.grad], want)
    assert arrivals == [1]


def test_trainable_zero3_partitioned_parameters_are_refused() -> None:
    """ZeRO-3 releases a parameter before the recompute's backward makes its gradient; refused up front (frozen
    ones, LoRA's base weights, are fine: the recompute's module hooks gather them)."""
    mlp = llama_mlp()
    mlp.up_proj.weight.ds_id = 7  # what marks a partitioned parameter (zero/stage3/ds_attributes.py)
    x = torch.randn(1, 4, HIDDEN)
    with pytest.raises(ValueError, match=r"tiled_mlp: a trainable parameter of shape \(\) is partitioned by ZeRO-3"):
        tiled_mlp(mlp, x, 2)
    mlp.up_proj.weight.requires_grad_(False)
    tiled_mlp(mlp, x, 2).sum().backward()
    assert mlp.up_proj.weight.grad is None and mlp.down_proj.weight.grad is not None


def labels_with_gaps() -> torch.Tensor:
    """[2, 13] labels, -100 over a prompt: of 2 × 13 = 26 tokens in tiles of 7 (tiles=4, the last of 5), the whole
    first tile and three of the second are ignored; the second row ends in two ignored (padding)."""
    torch.manual_seed(1)
    labels = torch.randint(0, VOCAB, (2, 13))
    labels[0, :10] = -100
    labels[1, 11:] = -100
    return labels


@pytest.mark.parametrize("tiles", [1, 4, 5, 26, 40])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_cross_entropy_equals_cross_entropy_on_the_full_logits(tiles: int, reduction: str) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(2, 13, HIDDEN, requires_grad=True)
    labels = labels_with_gaps()
    want = F.cross_entropy(head(hidden).reshape(-1, VOCAB), labels.reshape(-1), reduction=reduction)
    (3 * want).backward()  # a scaled loss (loss scaling, gradient accumulation): the gradients scale with it
    want_grads = grads_of(head, hidden)
    got = tiled_cross_entropy(hidden, head, labels, tiles, reduction=reduction)
    (3 * got).backward()
    torch.testing.assert_close(got, want, **TOL)
    assert_same(grads_of(head, hidden), want_grads)


def test_tiled_cross_entropy_frozen_head_and_all_ignored() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    hidden = torch.randn(1, 8, HIDDEN, requires_grad=True)
    labels = labels_with_gaps()[:1, :8]
    want = F.cross_entropy(head(hidden)[0], labels[0])
    want.backward()
    want_grad, hidden.grad = hidden.grad, None
    tiled_cross_entropy(hidden, head, labels, 3).backward()
    assert head.weight.grad is None
    torch.testing.assert_close(hidden.grad, want_grad, **TOL)
    # No counted token at all: NaN, as F.cross_entropy's mean over nothing.
    ignored = torch.full((1, 8), -100)
    assert tiled_cross_entropy(hidden, head, ignored, 3).isnan()
    assert F.cross_entropy(head(hidden)[0], ignored[0]).isnan()
    with pytest.raises(ValueError, match=r"labels \(1, 7\) must have the shape of hidden_states \(1, 8, 16\)"):
        tiled_cross_entropy(hidden, head, ignored[:, :7], 3)


def test_deepspeed_named_loss_and_tiled_compute() -> None:
    """`TiledFusedLogitsLoss.apply` and `sequence_tiled_compute` with DeepSpeed's arguments: a per-tile sum
    ("sum") is the full cross-entropy's sum; a mask is handed to the function tile by tile."""
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(2, 12, HIDDEN, requires_grad=True)
    labels = labels_with_gaps()[:, :12]
    mask = labels != -100
    want = F.cross_entropy(head(hidden).reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    want.backward()
    want_grads = grads_of(head, hidden)

    def loss_fn(self: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x), torch.where(m, y, -100), reduction="sum")

    got = TiledFusedLogitsLoss.apply(loss_fn, head, hidden, labels, mask, 5, [head.weight], "sum")
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    assert_same(grads_of(head, hidden), want_grads)

    got = sequence_tiled_compute(
        lambda hidden_states, labels, reduction: F.cross_entropy(head(hidden_states).reshape(-1, VOCAB),
                                                                 labels.reshape(-1), reduction=reduction),
        12, 4, {"hidden_states": hidden, "labels": labels}, {"reduction": "sum"}, "hidden_states",
        [head.weight], output_unshard_dimension=0, output_reduction="sum")
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    assert_same(grads_of(head, hidden), want_grads)


# What each trick saves, measured.


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """The bytes of the tensors saved for backward that are alive at once, at their peak, storage by storage
    (views of one tensor count once) and without `exclude` (the parameters). A saved tensor dies when autograd
    drops what the pack hook returned."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0
        super().__init__(self._pack, lambda held: held.tensor)

    def _pack(self, tensor: torch.Tensor) -> Any:
        held = _Held(tensor)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if tensor.numel() and key not in self.exclude:
            entry = self.live.setdefault(key, [0, storage.nbytes()])
            if entry[0] == 0:
                self.now += entry[1]
                self.peak = max(self.peak, self.now)
            entry[0] += 1
            weakref.finalize(held, self._release, key)
        return held

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[key]


class _Held:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Largest(TorchDispatchMode):
    """The most elements of any tensor an operation makes."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def measure(step: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> tuple[int, int]:
    """(peak saved bytes, largest tensor's elements) over one forward and backward."""
    saved, largest = SavedBytes(params), Largest()
    with saved, largest:
        step().backward()
    assert not saved.live, "saved tensors outlived the backward"
    return saved.peak, largest.numel


SEQ, TILES = 512, 8


def test_tiled_mlp_saves_one_tiles_activations() -> None:
    mlp = llama_mlp()
    x = torch.randn(1, SEQ, HIDDEN, requires_grad=True)
    params = list(mlp.parameters())
    plain = measure(lambda: mlp(x).sum(), params)
    tiled = measure(lambda: tiled_mlp(mlp, x, TILES).sum(), params)
    print(f"MLP, peak saved bytes and largest tensor: untiled {plain}, {TILES} tiles {tiled}")
    tile = SEQ // TILES
    # Untiled: the input and four [seq, intermediate] activations (gate, its SiLU, up, their product). Tiled:
    # the input, and while a tile is recomputed, that tile's four.
    assert plain[0] == SEQ * (HIDDEN + 4 * INTERMEDIATE) * 4
    assert tiled[0] == (SEQ * HIDDEN + 4 * tile * INTERMEDIATE) * 4
    assert plain[1] == SEQ * INTERMEDIATE and tiled[1] == max(SEQ * HIDDEN, tile * INTERMEDIATE)


def test_tiled_loss_never_makes_the_full_logits() -> None:
    torch.manual_seed(0)
    vocab = 1024
    head = torch.nn.Linear(HIDDEN, vocab, bias=False)
    hidden = torch.randn(1, SEQ, HIDDEN, requires_grad=True)
    labels = torch.randint(0, vocab, (1, SEQ))
    labels[:, :100] = -100
    plain = measure(lambda: F.cross_entropy(head(hidden)[0], labels[0]), [head.weight])
    tiled = measure(lambda: tiled_cross_entropy(hidden, head, labels, TILES), [head.weight])
    print(f"loss, peak saved bytes and largest tensor: untiled {plain}, {TILES} tiles {tiled}")
    tile = SEQ // TILES
    assert plain[1] == SEQ * vocab  # the meter sees the full logits where they exist
    assert tiled[1] == tile * vocab  # here never more than one tile's (the head's gradient is [vocab, hidden])
    assert plain[0] >= SEQ * vocab * 4  # the log-softmax over every token is kept for backward
    assert tiled[0] < SEQ * vocab * 4 / (TILES / 2)


# Gradient checkpointing with the kept inputs in host memory.


def tiny_llama() -> torch.nn.Module:
    from tests.ulysses_models import build

    return build()


def batch() -> dict[str, torch.Tensor]:
    from tests.ulysses_models import sample

    return sample(3)


class Recording(offload.HostStash):
    """What the stash is handed: every tensor kept for a recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.held: list[str] = []

    def _pack(self, tensor: torch.Tensor) -> Any:
        device, held = super()._pack(tensor)
        self.shapes.append(tuple(tensor.shape))
        self.held.append(held.device.type)
        return device, held


def train_step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed gradient_checkpointing_enable
        loss = model(**batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def enable_checkpointing(model: torch.nn.Module, reentrant: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("enabled_after", [False, True])
def test_offload_keeps_exactly_the_checkpointed_inputs_and_changes_nothing(monkeypatch, reentrant: bool,
                                                                          enabled_after: bool) -> None:
    model = tiny_llama()
    enable_checkpointing(model, reentrant)
    want_loss, want_grads = train_step(model)

    monkeypatch.setattr(offload, "HostStash", Recording)
    model = tiny_llama()
    if not enabled_after:
        enable_checkpointing(model, reentrant)
    handle = offload.offload_checkpoints(model)
    if enabled_after:  # as the Trainer does at the start of train()
        enable_checkpointing(model, reentrant)
    loss, grads = train_step(model)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=0)
    # The two decoder layers' inputs (the hidden states [1, 16, 32]) went through the stash, and nothing else.
    hidden = (1, 16, 32)
    assert handle.stash.shapes == [hidden, hidden] and handle.stash.tensors == 2
    assert handle.stash.held == ["cpu", "cpu"]
    handle.remove()
    train_step(model)
    assert handle.stash.tensors == 2  # removed: nothing more through it
    assert not any(isinstance(m.__dict__.get("_gradient_checkpointing_func"), offload._Offloaded)
                   for m in model.modules())


def test_offload_refuses_what_would_offload_nothing() -> None:
    model = tiny_llama()
    with offload.offload_checkpoints(model):
        with pytest.raises(RuntimeError, match="offload_checkpoints: gradient checkpointing is off in "
                                               "LlamaForCausalLM, so nothing would be kept in host memory"):
            train_step(model)
        with torch.no_grad():
            model(**batch())  # no backward, nothing to keep: fine
    with pytest.raises(TypeError, match="offload_checkpoints: Linear has no module with Hugging Face's "
                                        "`gradient_checkpointing` flag"):
        offload.offload_checkpoints(torch.nn.Linear(2, 2))


def test_offloaded_checkpoint_function() -> None:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 8, requires_grad=True)
    block(x).square().sum().backward()
    want = grads_of(block, x)
    stash = offload.HostStash()
    for reentrant in (True, False):
        offload.offloaded_checkpoint(block, x, stash=stash, use_reentrant=reentrant).square().sum().backward()
        assert_same(grads_of(block, x), want)
    assert stash.tensors >= 2  # at least x, each time
