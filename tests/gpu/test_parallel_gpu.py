"""The pipeline and tensor-parallel engines at size 1, and 1-bit Adam, at world 1 on the device (CUDA + NCCL in
`make test-gpu`, CPU + gloo in CI), against the single-process oracles of the CPU tests (fp32 to 1e-5 relative):

- a PipelineModule of one stage under train_batch (tests/distributed/test_pipeline.py's script and oracle):
  SGD clipped, AdamW with ZeRO-1, a tied layer, activation checkpointing under the GPipe schedule;
- a Megatron-style GPT of tensor-parallel layers as one pipeline stage at tensor-parallel size 1
  (tests/distributed/test_three_d.py's);
- AutoTP at tp 1 (`tensor_parallel.autotp_size: 1`): a Hugging Face LLaMA, with LoRA, and a model of shardwise's
  Megatron-style layers (tests/distributed/test_tensor_parallel.py's);
- 1-bit Adam: its sign codec on device tensors equals the codec's layout computed on the CPU bit for bit through
  rounds of error feedback (values whose sums are exact in any order), and to a stated bound on random values;
  1-bit Adam training at world 1 (exact Adam to the freeze, then the frozen variance) matches a plain-PyTorch
  oracle on the CPU and, on CUDA, the same engine run on the CPU.

Every engine trains in one child process (a module fixture); the tests read its results.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.optim.onebit.sign_codec import SignCodec
from tests import pipeline_models as pm
from tests import tensor_parallel_models as tp_models
from tests.distributed import test_pipeline as pipe_tests
from tests.distributed import test_three_d as three_d_tests
from tests.distributed.test_onebit import _config as onebit_config
from tests.gpu.device import CUDA, DEVICE, device_of, on_device
from tests.harness import run_distributed
from tests.parity import assert_close_run, engine_run, global_batch, make_model, param_groups

Case = pipe_tests.Case
PIPE_CASES = [
    Case("1 stage, sgd, clipped", 1, [0, 8], clip=pipe_tests.CLIP),
    Case("1 stage, adamw, zero-1, clipped", 1, [0, 8], "adamw", clip=pipe_tests.CLIP, zero=1),
    Case("1 stage, tied", 1, [0, 8], tied=True),
    Case("1 stage, gpipe, activation checkpointing", 1, [0, 8], clip=pipe_tests.CLIP, schedule="gpipe",
         module={"activation_checkpoint_interval": 2}),
]
GPT_STEPS = 4
TP1 = {"llama": ("llama", False, False), "llama-lora": ("llama", False, True),
       "megatron-layers": ("megatron", False, False)}  # name: (kind, tied embeddings, LoRA)
ONEBIT_STEPS, FREEZE = 10, 4
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)  # test_onebit's
CODEC_ROUNDS = 4


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def _guarded(fn, *args, **kwargs) -> Any:
    """A case that raises reports its traceback to its own test instead of ending the sweep."""
    import traceback

    try:
        return _cpu(fn(*args, **kwargs))
    except Exception:  # noqa: BLE001 - the test of that case raises it
        return traceback.format_exc()


def _with_engine_devices(fn, *args: Any) -> dict[str, Any]:
    """`fn(*args)`'s result with "device": the device of each engine shardwise.initialize built meanwhile."""
    import shardwise

    seen: list[str] = []
    initialize = shardwise.initialize

    def recording(*a: Any, **kw: Any) -> Any:
        out = initialize(*a, **kw)
        seen.append(device_of(out[0]))
        return out

    shardwise.initialize = recording  # the CPU tests' helpers call shardwise.initialize by attribute
    try:
        result = fn(*args)
    finally:
        shardwise.initialize = initialize
    return {**result, "device": seen}


def _codec_rounds(values: list[torch.Tensor], block: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Error feedback as CompressedAllReduce runs it: each round's values are added to what the last round lost,
    compressed, and the loss kept. (packed, decompressed, residual) per round, on the values' device."""
    codec = SignCodec(block=block)
    work = torch.zeros_like(values[0])
    out = []
    for v in values:
        work.add_(v)
        packed = torch.empty(v.shape[0], codec.row_bytes(v.shape[1]), dtype=torch.uint8, device=v.device)
        codec.compress_rows(work, packed, residual=work)
        out.append((packed.clone(), codec.decompress_rows(packed, v.shape[1]), work.clone()))
    return out


def _dyadic(rounds: int) -> list[torch.Tensor]:
    """Multiples of 1/16 in [-1, 1] (zeros included), one (3, 64) tensor a round. With blocks of 8 each round's mean
    divides by 8 (3 more bits below the point) and a residual is no larger than its value, so the magnitudes grow by
    at most 1 a round: in round 4 a block's sum, in any order, needs 18 significant bits, within fp32's 24. Every
    sum, mean and residual is exact, so a device's reduction order cannot change a bit."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(-16, 17, (3, 64), generator=g).float() / 16 for _ in range(rounds)]


def _random_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    return torch.randn(3, 2048, generator=g) * torch.logspace(-3, 3, 2048)


def _onebit(steps: int) -> dict[str, Any]:
    config = onebit_config("OneBitAdam", 1, freeze_step=FREEZE)
    losses, params, engine = engine_run(config, steps)
    return {"losses": losses, "params": params, "device": device_of(engine),
            "optimizer": type(engine.optimizer).__name__}


def _onebit_on_cpu(steps: int) -> dict[str, Any]:
    """The same run with shardwise's device choice forced to the CPU (gloo), in a process of its own."""
    import shardwise.accelerator

    shardwise.accelerator.has_cuda = lambda: False
    return _cpu(_onebit(steps))


def _sweep() -> dict[str, Any]:
    out: dict[str, Any] = {case.name: _guarded(_with_engine_devices, pipe_tests._train, case) for case in PIPE_CASES}
    # one stage, autotp_size 1, ZeRO 0, AdamW, from step 0
    out["gpt"] = _guarded(_with_engine_devices, three_d_tests._train, 1, 1, 0, 0, GPT_STEPS)
    for name, (kind, tie, lora) in TP1.items():
        out[name] = _guarded(_with_engine_devices, tp_models.run_case, kind, tie, 1, 0, lora)
    out["codec dyadic"] = _guarded(_codec_rounds, [v.to(DEVICE) for v in _dyadic(CODEC_ROUNDS)], 8)
    out["codec random"] = _guarded(_codec_rounds, [_random_values().to(DEVICE)], 1024)
    out["onebit"] = _guarded(_onebit, ONEBIT_STEPS)
    return out


@pytest.fixture(scope="module")
def swept() -> dict[str, Any]:
    return on_device(_sweep, timeout=600)


def _result(swept: dict[str, Any], name: str) -> Any:
    assert not isinstance(swept[name], str), swept[name]  # a traceback
    return swept[name]


# --- pipeline and tensor-parallel engines ----------------------------------------------------------------------
@pytest.mark.parametrize("case", PIPE_CASES, ids=lambda c: c.name)
def test_one_stage_pipeline_trains_like_the_oracle(case, swept) -> None:
    run = _result(swept, case.name)
    assert run["device"] == [DEVICE]
    pipe_tests._assert_matches_oracle(case, [run])  # losses and parameters to 1e-5
    assert run["sends"] == run["recvs"] == 0  # one stage: nothing crosses a boundary
    recomputed = 2 if case.module.get("activation_checkpoint_interval") else 1
    assert run["forwards"] == recomputed * run["blocks_here"] * pipe_tests.ACCUM * pipe_tests.STEPS


def test_megatron_gpt_as_one_stage_at_tp1_trains_like_the_oracle(swept) -> None:
    run = _result(swept, "gpt")
    assert run["device"] == [DEVICE] and run["shards"] == {}  # tp 1: nothing split
    ref_losses, ref_params = pm.gpt_oracle_run(GPT_STEPS, three_d_tests.MICRO * three_d_tests.ACCUM, three_d_tests.LR,
                                               three_d_tests.CLIP)
    three_d_tests._assert_matches_oracle([run], ref_losses, ref_params)


@pytest.mark.parametrize("name", list(TP1))
def test_autotp_at_tp1_trains_like_the_oracle(name, swept) -> None:
    kind, tie, lora = TP1[name]
    run = _result(swept, name)
    assert run["device"] == [DEVICE] and run["shards"] == {}
    tp_models.assert_matches(run, tp_models.oracle(kind, tie, lora), label=name)  # losses, norms, params to 1e-5


# --- 1-bit Adam ----------------------------------------------------------------------------------------------
def _reference_codec(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The [Note: sign row layout] of optim/onebit/sign_codec.py written out on the CPU: signs (>= 0 is 1) packed
    8 a byte, element 8i+j in bit j of byte i, then each block's mean |x| as fp32 bytes; decoded sign * mean;
    residual values - decoded."""
    rows, n = values.shape
    blocks = values.view(rows, n // block, block)
    scales = blocks.abs().sum(dim=2) / block
    positive = blocks >= 0
    bits = positive.reshape(rows, n // 8, 8).to(torch.int64) << torch.arange(8)
    packed = torch.cat([bits.sum(dim=2).to(torch.uint8), scales.contiguous().view(torch.uint8)], dim=1)
    decoded = torch.where(positive, scales.unsqueeze(2), -scales.unsqueeze(2)).view(rows, n)
    return packed, decoded, values - decoded


def test_sign_codec_on_the_device_equals_its_layout_bit_for_bit_through_error_feedback(swept) -> None:
    got = _result(swept, "codec dyadic")
    work = torch.zeros(3, 64)
    assert len(got) == CODEC_ROUNDS
    for round_, (v, (packed, decoded, residual)) in enumerate(zip(_dyadic(CODEC_ROUNDS), got)):
        work = work + v
        ref_packed, ref_decoded, work = _reference_codec(work, 8)
        assert torch.equal(packed, ref_packed), f"round {round_}: packed bytes"
        assert torch.equal(decoded, ref_decoded), f"round {round_}: decompressed"
        assert torch.equal(residual, work), f"round {round_}: residual (error feedback)"
        assert residual.abs().max() > 0  # something was lost and fed back


def test_sign_codec_on_the_device_equals_the_cpus_on_random_values(swept) -> None:
    ((packed, decoded, residual),) = _result(swept, "codec random")
    values = _random_values()
    ((cpu_packed, cpu_decoded, _),) = _codec_rounds([values.clone()], 1024)
    signs = 2048 // 8
    assert torch.equal(packed[:, :signs], cpu_packed[:, :signs])  # every sign, bit for bit
    scales, cpu_scales = (p[:, signs:].contiguous().view(torch.float32) for p in (packed, cpu_packed))
    # a block's mean |x| sums 1024 fp32 values in the device's order: each order's rounding is at most ~1e-6 of the
    # sum (positive terms); a wrong scale (a max, a mean of squares, a block off by one) is off by percents
    torch.testing.assert_close(scales, cpu_scales, rtol=1e-5, atol=0)
    assert torch.equal(decoded.abs().view(3, 2, 1024), scales.view(3, 2, 1).expand(3, 2, 1024))
    assert torch.equal(decoded.sign(), cpu_decoded.sign())
    assert torch.equal(residual, values - decoded)  # error feedback keeps exactly what was lost


def _frozen_adam_oracle(steps: int, freeze: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """1-bit Adam at world 1 in plain PyTorch: torch's AdamW to the freeze; then the momentum alone moves on, the
    variance and its bias correction stay at the freeze's, and an element whose variance is 0 does not move."""
    model = make_model()
    groups = param_groups(model)
    for group in groups:
        group["params"] = [p for p in group["params"] if p.requires_grad]
    opt = torch.optim.AdamW(groups, **ADAM)
    (beta1, beta2), losses = ADAM["betas"], []
    for step in range(1, steps + 1):
        loss = model(*global_batch(step - 1, 8))
        loss.backward()
        losses.append(loss.item())
        if step <= freeze:
            opt.step()
        else:
            with torch.no_grad():
                for group in opt.param_groups:
                    for p in group["params"]:
                        state = opt.state[p]
                        p.mul_(1 - ADAM["lr"] * group["weight_decay"])
                        state["exp_avg"].lerp_(p.grad, 1 - beta1)
                        v = state["exp_avg_sq"]
                        denom = (v.sqrt() / (1 - beta2**freeze) ** 0.5).add_(ADAM["eps"])
                        denom.masked_fill_(v == 0, float("inf"))
                        p.addcdiv_(state["exp_avg"], denom, value=-ADAM["lr"] / (1 - beta1**step))
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_bit_adam_at_world_1_matches_the_cpu(swept) -> None:
    run = _result(swept, "onebit")
    assert run["device"] == DEVICE and run["optimizer"] == "OneBitAdam"
    ref_losses, ref_params = _frozen_adam_oracle(ONEBIT_STEPS, FREEZE)
    assert_close_run(run["losses"], run["params"], ref_losses, ref_params, rtol=1e-5)
    # the frozen steps are not Adam's: the oracle's AdamW for every step would be another run
    adam_losses, _ = _frozen_adam_oracle(ONEBIT_STEPS, ONEBIT_STEPS)
    assert abs(adam_losses[-1] - ref_losses[-1]) > 1e-4 * ref_losses[-1]
    if CUDA:  # the engine itself on the CPU, in a process of its own
        (cpu,) = run_distributed(_onebit_on_cpu, 1, ONEBIT_STEPS, timeout=300, start_method="spawn")
        assert cpu["device"] == "cpu"
        assert_close_run(run["losses"], run["params"], cpu["losses"], cpu["params"], rtol=1e-5)
