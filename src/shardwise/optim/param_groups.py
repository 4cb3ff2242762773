"""What `initialize` is given to optimize (model_parameters, or a client optimizer's groups), checked
against the model before anything is built: an optimizer over no trainable parameter of the model
otherwise fails with torch's bare "optimizer got an empty parameter list", or trains nothing."""

from __future__ import annotations

from typing import Any

import torch


def check_model_parameters(groups: list[dict[str, Any]], model: torch.nn.Module, given: bool) -> None:
    """What was passed as model_parameters (or to the client optimizer) must be `model`'s, and some must train."""
    params = [p for g in groups for p in g["params"]]
    source = "model_parameters" if given else "model"
    if any(isinstance(p, tuple) for p in params):
        raise ValueError("model_parameters: got (name, parameter) pairs; pass model.parameters(), not named_parameters().")
    names = {id(p): n for n, p in model.named_parameters()}
    foreign = [p for p in params if id(p) not in names]
    if foreign:
        shapes = ", ".join(str(list(getattr(p, "shape", []))) for p in foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise ValueError(f"model_parameters: {len(foreign)} of the {len(params)} parameters given are not parameters of "
                         f"the model passed as model= (shapes {shapes}); pass that model's parameters, e.g. "
                         "model.parameters() or groups of them.")
    if not any(p.requires_grad for p in params):
        frozen = [names[id(p)] for p in params]
        shown = ", ".join(frozen[:6]) + (f", ... ({len(frozen)} in all)" if len(frozen) > 6 else "")
        what = "every parameter given is" if given else "every parameter of the model is"
        raise ValueError(f"{source}: {what} frozen (requires_grad=False), so nothing would train: "
                         f"{shown or 'no parameters at all'}. Unfreeze the ones to train (p.requires_grad_(True)) "
                         "before initialize, then pass [p for p in model.parameters() if p.requires_grad].")
