"""Backward and step semantics under DeepSpeed 0.19 and shardwise, at world size 2 (CPU, gloo, fp32 / bf16):
a direct `loss.backward()`, `step()` without backward, a nan loss, and two engines in one script (the DCGAN
tutorial's loop, tests/gan.py). Where DeepSpeed completes a case, shardwise must give the same numbers;
where it does not, tests/distributed/test_backward_semantics.py and tests/faults/test_nonfinite.py hold
shardwise to the torch oracle, and their comments record what DeepSpeed did.

Run as a module it prints what each library does in every case, errors included (the measurement those
comments quote):

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python -m tests.distributed.test_deepspeed_parity_backward

As tests (skipped without the real deepspeed; `make test-deepspeed` runs them):

    DS_ACCELERATOR=cpu PYTHONPATH=src:. .dsvenv/bin/python -m pytest tests/distributed/test_deepspeed_parity_backward.py -q
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch

from tests.reference import real_deepspeed

real_deepspeed()  # imported once here so the forked ranks inherit it; skips in shardwise's own venv

from tests.gan import gan_run  # noqa: E402
from tests.harness import run_distributed  # noqa: E402
from tests.parity import ds_config, make_model, micro_batch, param_groups  # noqa: E402

RTOL = 1e-5  # fp32; the SGD runs agree to a few ulps (tests/distributed/test_deepspeed_parity.py says why not 0)


def _engine(ds: Any, stage: int, precision: str, accum: int = 1, optimizer: str = "adamw") -> Any:
    model = make_model()
    extra: dict[str, Any] = {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if precision == "bf16":
        extra["bf16"] = {"enabled": True}
    config = ds_config(2, accum, optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 1e-2, **extra)
    engine, *_ = ds.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _weights(ds: Any, engine: Any) -> dict[str, torch.Tensor]:
    """Whole weights at every stage (both libraries pass parameters that are not partitioned through)."""
    with ds.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}


def _train(engine: Any, steps: int, direct: bool = False, nan_at: int = -1) -> None:
    import torch.distributed as dist

    accum = engine.gradient_accumulation_steps()
    for step in range(steps):
        for m in range(accum):
            loss = engine(*micro_batch(step, m, dist.get_rank(), 2, accum, 2))
            loss = loss * math.nan if step == nan_at else loss
            if direct:
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()


def _direct(ds: Any, stage: int, precision: str) -> dict[str, Any]:
    """SGD, gradient_accumulation_steps 2, three steps of loss.backward(); engine.backward(loss) for reference."""
    out = {}
    for direct in (False, True):
        engine = _engine(ds, stage, precision, accum=2, optimizer="sgd")
        _train(engine, 3, direct=direct)
        norm = engine.get_global_grad_norm()  # DeepSpeed's stage 0 in fp32 without clipping computes none
        out["direct" if direct else "engine"] = {"norm": None if norm is None else float(norm),
                                                 "weights": _weights(ds, engine)}
    return out


def _no_backward(ds: Any, stage: int, precision: str) -> dict[str, Any]:
    engine = _engine(ds, stage, precision)
    _train(engine, 2)
    before = _weights(ds, engine)
    engine.step()
    after = _weights(ds, engine)
    return {"moved": max((after[k] - before[k]).abs().max().item() for k in before),
            "global_steps": engine.global_steps}


def _nan(ds: Any, stage: int, precision: str) -> dict[str, Any]:
    engine = _engine(ds, stage, precision)
    _train(engine, 2)
    before = _weights(ds, engine)
    _train(engine, 1, nan_at=0)
    after = _weights(ds, engine)
    return {"moved": not all(torch.equal(before[k], after[k]) for k in before),
            "finite": all(bool(v.isfinite().all()) for v in after.values()), "skipped_steps": engine.skipped_steps}


def _gan(ds: Any, stage: int, precision: str) -> dict[str, Any]:
    d_losses, g_losses = gan_run(ds.__name__, stage, 6)
    return {"d": d_losses, "g": g_losses}


CASES = {"direct": _direct, "no_backward": _no_backward, "nan": _nan, "gan": _gan}


def _run(library: str, cases: list[tuple[str, int, str]]) -> dict[tuple[str, int, str], Any]:
    import torch.distributed as dist

    ds = importlib.import_module(library)
    if library == "deepspeed" and not dist.is_initialized():
        ds.init_distributed(dist_backend="gloo")
    return {case: CASES[case[0]](ds, case[1], case[2]) for case in cases}


# The cases DeepSpeed completes (see `main` for the others).
COMPARED = [("direct", s, "fp32") for s in (1, 2, 3)] + [("no_backward", 0, "fp32"), ("gan", 0, "fp32")] + \
           [("nan", s, "bf16") for s in (0, 1, 2, 3)] + [("nan", s, "fp32") for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[tuple[str, int, str], Any]]:
    return {library: run_distributed(_run, 2, library, COMPARED, timeout=600)[0] for library in ("deepspeed", "shardwise")}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(b), 1e-12)


@pytest.mark.parametrize("case", COMPARED, ids=lambda c: f"{c[0]}-stage{c[1]}-{c[2]}")
def test_matches_deepspeed(runs, case):
    ours, theirs = runs["shardwise"][case], runs["deepspeed"][case]
    kind = case[0]
    if kind == "direct":
        assert _close(ours["direct"]["norm"], theirs["direct"]["norm"])
        for name, ref in theirs["direct"]["weights"].items():
            torch.testing.assert_close(ours["direct"]["weights"][name], ref, rtol=RTOL, atol=RTOL)
    elif kind == "gan":
        assert all(map(_close, ours["d"] + ours["g"], theirs["d"] + theirs["g"])), (ours, theirs)
    elif kind == "no_backward":
        assert ours == theirs == {"moved": 0.0, "global_steps": 3}
    else:
        assert ours == theirs == {"moved": False, "finite": True, "skipped_steps": 1}


def main() -> None:
    """Every case for both libraries, one set of ranks per case (a library that fails leaves its ranks as they
    are); prints one line per case."""
    for kind in CASES:
        precisions = ("fp32", "bf16") if kind in ("direct", "nan") else ("fp32",)
        for precision in precisions:
            for stage in (0, 1, 2, 3):
                for library in ("deepspeed", "shardwise"):
                    case = (kind, stage, precision)
                    try:
                        result = run_distributed(_run, 2, library, [case], timeout=300)[0][case]
                        print(f"{library:9} {kind:11} stage {stage} {precision}: {_summary(kind, result)}", flush=True)
                    except Exception as e:  # noqa: BLE001 - a failure is what is measured here
                        print(f"{library:9} {kind:11} stage {stage} {precision}: raised {_last_error(str(e))}", flush=True)


def _summary(kind: str, result: dict[str, Any]) -> str:
    if kind == "direct":
        diff = max((result["direct"]["weights"][k] - v).abs().max().item() for k, v in result["engine"]["weights"].items())
        return (f"grad norm {result['direct']['norm']} (engine.backward: {result['engine']['norm']}), "
                f"max |weights - engine.backward's| {diff:.3g}")
    if kind == "gan":
        return "D " + " ".join(f"{x:.5f}" for x in result["d"]) + " | G " + " ".join(f"{x:.5f}" for x in result["g"])
    return str(result)


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if "Error" in line and not line.strip().startswith("File")]
    return lines[-1][:300] if lines else text[-300:]


if __name__ == "__main__":
    main()
