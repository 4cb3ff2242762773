"""Activation checkpointing at world 1 on the device (CUDA + NCCL in `make test-gpu`, CPU + gloo in CI): a model
whose forward calls DeepSpeed's `checkpointing.checkpoint(function, *args)` (shardwise.runtime.activation_checkpointing,
set up from the config's `activation_checkpointing` section by `configure(deepspeed_config=...)`, as Megatron-style
scripts do), at ZeRO-2 and ZeRO-3 (whose recompute gathers the partitioned parameters again), with gradient
clipping and gradient accumulation, with and without `cpu_checkpointing`, trains to the numbers of the run without
checkpointing and of a plain single-process PyTorch oracle (fp32 to 1e-5). With dropout, the recompute replays
the forward's random masks (the device's RNG state is restored), so the checkpointed run equals the plain one.

The checks that the feature really ran: each checkpointed block runs twice per micro-step (forward, then the
recompute in backward), and with `cpu_checkpointing` the tensors kept for the recompute go to host memory
(pinned on CUDA) and only then."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.device import CUDA, DEVICE, device_of, on_device
from tests.parity import DIM, VOCAB, assert_close_run, ds_config, global_batch, param_groups

STEPS, MICRO, ACCUM, LR, CLIP, BLOCKS = 5, 2, 2, 1e-2, 1.0, 2


class Block(torch.nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.up = torch.nn.Linear(DIM, 2 * DIM + 1)  # sizes that pad at any world size, as TinyNet's
        self.down = torch.nn.Linear(2 * DIM + 1, DIM)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.down(F.gelu(self.up(x))), self.dropout, self.training)


class CheckpointedNet(torch.nn.Module):
    """A residual stack whose blocks run through `checkpoint` when `checkpointing` is set; the output projection
    is tied to the embedding (the parameter is used twice, in and out of the checkpointed region)."""

    def __init__(self, checkpointing: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block(dropout) for _ in range(BLOCKS))
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from shardwise.runtime.activation_checkpointing import checkpoint

        x = self.embed(tokens)
        for block in self.blocks:
            x = x + (checkpoint(block, x) if self.checkpointing else block(x))
        logits = self.norm(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_net(checkpointing: bool, dropout: float = 0.0) -> CheckpointedNet:
    torch.manual_seed(0)
    return CheckpointedNet(checkpointing, dropout)


def _oracle() -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """The plain PyTorch loop, no checkpointing: the whole batch at once (the engine accumulates it in ACCUM
    micro-batches of equal size, whose mean losses average to the whole batch's), AdamW, clipped to CLIP."""
    model = make_net(checkpointing=False)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.99), eps=1e-8)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(*global_batch(step, MICRO * ACCUM))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _run(stage: int, checkpointing: bool, cpu_checkpointing: bool, dropout: float) -> dict[str, Any]:
    import shardwise
    from shardwise.runtime import activation_checkpointing
    from tests.parity import full_state_dict, train_steps

    section = {"cpu_checkpointing": cpu_checkpointing, "partition_activations": True,
               "synchronize_checkpoint_boundary": True}
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 1000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned: the recompute must gather
    config = ds_config(MICRO, ACCUM, clip=CLIP, lr=LR, zero_optimization=zero, activation_checkpointing=section)
    checkpointer = activation_checkpointing.configure(None, deepspeed_config=config)

    packed: list[tuple[str, str, bool]] = []  # (device of a tensor kept for the recompute, where it was kept, pinned)
    save_on_cpu = torch.autograd.graph.save_on_cpu

    class Spy(save_on_cpu):  # the checkpointer looks save_on_cpu up at each call: this sees what it keeps
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pack = self.pack_hook

            def spy(tensor: torch.Tensor) -> Any:
                out = pack(tensor)
                packed.append((tensor.device.type, out[1].device.type, out[1].is_pinned()))
                return out

            self.pack_hook = spy

    torch.autograd.graph.save_on_cpu = Spy
    try:
        model = make_net(checkpointing, dropout)
        engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
        block_calls = [0]
        for block in engine.module.blocks:
            block.register_forward_pre_hook(lambda *_: block_calls.__setitem__(0, block_calls[0] + 1))
        torch.manual_seed(1234)  # the same dropout masks in every run (on the engine's device)
        losses = train_steps(engine, 0, STEPS)
    finally:
        torch.autograd.graph.save_on_cpu = save_on_cpu
    return {"losses": losses, "params": {k: v.float() for k, v in full_state_dict(engine).items()},
            "device": device_of(engine), "block_calls": block_calls[0], "checkpoint_calls": checkpointer.calls,
            "packed": packed}


# (name, stage, checkpointing, cpu_checkpointing, dropout)
RUNS = [(f"z{stage}-{mode}{'-dropout' if dropout else ''}", stage, mode != "plain", mode == "cpu", dropout)
        for stage, dropout in ((2, 0.0), (3, 0.0), (3, 0.1)) for mode in ("plain", "checkpointed", "cpu")
        if not (dropout and mode == "checkpointed")]


def _sweep() -> dict[str, dict[str, Any]]:
    return {name: _run(stage, checkpointing, cpu, dropout) for name, stage, checkpointing, cpu, dropout in RUNS}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    return on_device(_sweep, timeout=600)


def test_the_oracle_clips_and_learns() -> None:
    """What the parity below rests on: clipping is active (a clip that never engages would not be tested) and the
    loss falls."""
    losses, _, norms = _oracle()
    assert sum(n > CLIP for n in norms) >= 3, norms
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("run", [r for r in RUNS if not r[4]], ids=lambda r: r[0])
def test_checkpointed_run_matches_the_plain_run_and_the_oracle(run, runs) -> None:
    name, stage, checkpointing, cpu, _ = run
    got, plain = runs[name], runs[f"z{stage}-plain"]
    assert got["device"] == DEVICE
    micro_steps = STEPS * ACCUM
    # The feature ran: every block once per micro-step in forward, and once more (the recompute) when checkpointed.
    assert got["checkpoint_calls"] == (BLOCKS * micro_steps if checkpointing else 0)
    assert got["block_calls"] == BLOCKS * micro_steps * (2 if checkpointing else 1), got["block_calls"]
    _assert_kept_on_the_host(got["packed"], cpu, BLOCKS * micro_steps)
    # fp32: the recompute runs the same kernels on the same values, so checkpointing changes nothing; against the
    # oracle (which shares no code with shardwise, and runs on the CPU) 1e-5 relative, as tests/parity.py says.
    assert_close_run(got["losses"], got["params"], plain["losses"], plain["params"], rtol=1e-5)
    ref_losses, ref_params, _ = _oracle()
    assert_close_run(got["losses"], got["params"], ref_losses, ref_params, rtol=1e-5)


def test_recompute_replays_the_dropout_masks(runs) -> None:
    plain, checkpointed = runs["z3-plain-dropout"], runs["z3-cpu-dropout"]
    assert checkpointed["block_calls"] == 2 * plain["block_calls"]
    ref_losses, _, _ = _oracle()
    # The dropout is live: the losses are not the dropout-free ones.
    assert max(abs(a - b) / b for a, b in zip(plain["losses"], ref_losses)) > 1e-3, (plain["losses"], ref_losses)
    # The recompute in backward restores the RNG state the forward had, so it draws the same masks: the gradients,
    # hence every later loss and the parameters, are those of the run without checkpointing (fp32, 1e-5).
    assert_close_run(checkpointed["losses"], checkpointed["params"], plain["losses"], plain["params"], rtol=1e-5)


def _assert_kept_on_the_host(packed: list[tuple[str, str, bool]], cpu: bool, calls: int) -> None:
    if not cpu:
        assert not packed, f"cpu_checkpointing is off, yet tensors went through save_on_cpu: {packed[:4]}"
        return
    assert len(packed) >= calls, f"{len(packed)} tensors kept through save_on_cpu for {calls} checkpointed calls"
    assert {p[1] for p in packed} == {"cpu"}, packed[:4]
    if CUDA:  # the checkpointed block's input moved off the GPU, into page-locked memory (an asynchronous copy)
        assert all(p == ("cuda", "cpu", True) for p in packed), packed[:4]
