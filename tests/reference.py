"""The real DeepSpeed, as a reference to compare against, or a skip that says where the comparison runs.

shardwise's own venv has the compatibility package (`compat/deepspeed`) installed, which answers to
`import deepspeed` too; comparing shardwise with itself would prove nothing, so a module that needs the
real DeepSpeed skips there. `.ci/run` (`make test-deepspeed`) runs these modules again in `.dsvenv`, where
deepspeed==0.19.8 is installed, and there they must run: `SHARDWISE_REQUIRE_DEEPSPEED=1` turns the skip
into a failure.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest

SHARDWISE_VERSION_SUFFIX = "+shardwise"


def is_compat(module: ModuleType) -> bool:
    return str(getattr(module, "__version__", "")).endswith(SHARDWISE_VERSION_SUFFIX)


def real_deepspeed() -> ModuleType:
    """Import and return the real DeepSpeed; skip the calling module (or fail, in CI's parity run) without it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    reason = None
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - any import failure means "no reference to compare against"
        reason = f"deepspeed is not importable ({type(e).__name__}: {e})"
    else:
        if is_compat(deepspeed):
            reason = "`deepspeed` here is shardwise's compatibility package, not DeepSpeed"
    if reason is None:
        serve_cpu_info_once()
        lift_cpu_fp16_gate()
        return deepspeed
    message = (f"{reason}; this module compares against the real DeepSpeed 0.19.8. Run it with "
               "`make test-deepspeed` (a .dsvenv with deepspeed==0.19.8), as .ci/run does.")
    if os.environ.get("SHARDWISE_REQUIRE_DEEPSPEED") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)
    raise AssertionError("unreachable")


def serve_cpu_info_once() -> None:
    """py-cpuinfo answers every `get_cpu_info()` by starting a new interpreter (~1 s of CPU), and DeepSpeed asks on
    each CPU-Adam it builds and each op it loads, in every rank. The machine does not change within a test session:
    asked once here, before the harness forks the ranks, the same answer is given to every later caller."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "served_once", False):
        return
    info = cpuinfo.get_cpu_info()

    def get_cpu_info() -> dict:
        return dict(info)

    get_cpu_info.served_once = True
    cpuinfo.get_cpu_info = get_cpu_info


def lift_cpu_fp16_gate() -> None:
    """DeepSpeed's CPU accelerator says fp16 is unsupported unless oneDNN has fp16 kernels for this CPU (Intel's
    AVX512-FP16/AMX-FP16; not AMD EPYC, not older Intel), and its engine then refuses an fp16 config ("Type fp16 is
    not supported on your device"). Its fp16 path itself (loss scaling, fp32 masters) runs on torch's CPU kernels
    on any x86 CPU, and shardwise's side of each comparison runs on the same kernels on the same machine: the
    reference lifts the gate instead of its fp16 comparisons failing on such machines."""
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" or accelerator.is_fp16_supported():
        return
    kind = type(accelerator)
    kind.is_fp16_supported = lambda self: True
    kind.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]
