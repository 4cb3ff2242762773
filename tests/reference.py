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
        return deepspeed
    message = (f"{reason}; this module compares against the real DeepSpeed 0.19.8. Run it with "
               "`make test-deepspeed` (a .dsvenv with deepspeed==0.19.8), as .ci/run does.")
    if os.environ.get("SHARDWISE_REQUIRE_DEEPSPEED") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)
    raise AssertionError("unreachable")
