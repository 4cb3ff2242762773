"""Hugging Face's weight initialisation for models built inside `zero.Init`.

A `PreTrainedModel` initialises its weights in `post_init`, at the end of its constructor, when `zero.Init`
has already partitioned every submodule: its init functions would see empty tensors (a no-op for
`normal_`, an IndexError for the zeroed `padding_idx` row of an embedding). While `zero.Init` is active,
`PreTrainedModel.initialize_weights` is replaced by a walk that does the same work one module at a time
with that module's parameters gathered, so the peak stays one module's parameters.

Every rank runs the init functions, in the order Hugging Face does, so random number generators stay in
step across ranks (later modules built inside `Init` must draw the same values everywhere) and a model built
after `torch.manual_seed(s)` equals one built without `Init`; rank 0's values are then broadcast, so ranks
seeded differently still agree.

transformers' own ZeRO-3 path (`from_pretrained` / `_from_config` under a stage-3 `HfDeepSpeedConfig`) never
reaches this: it builds inside `no_init_weights()`, which makes `init_weights` a no-op, then initialises with
its `initialize_weights_zero3`. The patch is for models a user builds inside `zero.Init()` directly, which
would otherwise keep torch's default init and fail on the padding row (tests/distributed/test_zero3_models.py,
`test_hugging_face_initialisation_inside_zero_init_matches_a_plain_build`, fails without it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def partitioned_hf_initialisation(is_partitioned: Callable[[torch.nn.Parameter], bool],
                                  gathered: Callable[..., contextlib.AbstractContextManager]) -> Iterator[None]:
    """Within the block, `PreTrainedModel.initialize_weights` works on partitioned models.

    Does nothing when transformers is not imported (nothing built in the block can be a `PreTrainedModel`
    then) or is too old to have the per-module `_initialize_weights` this relies on.
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    if base is None or not hasattr(base, "_initialize_weights"):
        yield
        return
    original = base.__dict__["initialize_weights"]
    guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", contextlib.nullcontext)

    def initialize_weights(model: Any) -> None:
        if not any(is_partitioned(p) for p in model.parameters()):
            return original(model)
        custom = model.is_custom_code()

        def visit(module: torch.nn.Module, init_fn: Callable[[torch.nn.Module, bool], None]) -> None:
            direct = []
            for child in module.children():
                nested = isinstance(child, base)
                visit(child, child._initialize_weights if nested else init_fn)
                if not nested:  # `_init_weights` of a module may set its direct children's parameters
                    direct += child.parameters(recurse=False)
            if getattr(module, "_is_hf_initialized", False):
                return
            with gathered([*module.parameters(recurse=False), *direct], modifier_rank=0):
                init_fn(module, custom)

        with torch.no_grad(), guard():
            visit(model, model._initialize_weights)

    base.initialize_weights = initialize_weights
    try:
        yield
    finally:
        base.initialize_weights = original
