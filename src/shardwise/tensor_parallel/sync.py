"""Every tensor-parallel rank starts from its group's first rank's whole model, before AutoTP splits it.

Each rank builds the model whole and keeps its pieces. Ranks that built it differently (a script that seeds each
rank differently, or not at all) would otherwise train replicated parameters that never agree, and split ones
cut from different models, without a word. Broadcasting before the split makes both come from one model; a rank
whose copy differed says so, since the same mistake may hide elsewhere in the script (data, dropout).
"""

from __future__ import annotations

import logging

import torch

from .comm import TensorLink

logger = logging.getLogger(__name__)


def sync_from_first(model: torch.nn.Module, link: TensorLink, device: torch.device) -> list[str]:
    """Give every rank of `link`'s group rank 0's parameters and buffers (the whole model, before splitting);
    `device` is where the group's backend takes tensors. Returns the names that differed on this rank."""
    differed: list[tuple[str, float]] = []
    tensors = [*model.named_parameters(), *model.named_buffers()]
    with torch.no_grad():
        for name, tensor in tensors:
            first = tensor.detach().to(device, copy=True)
            link.comm.broadcast(first, 0, link.group).wait()
            if link.rank == 0:
                continue
            first = first.to(tensor.device)
            if not torch.equal(first, tensor):
                differed.append((name, _gap(first, tensor)))
                tensor.copy_(first)
    if differed:
        largest = max((gap for _, gap in differed if gap == gap), default=float("nan"))
        logger.warning(
            "tensor parallel: tensor-parallel rank %d built a different model from rank 0 (%d of %d tensors differ, "
            "by up to %.3g: %s): were the ranks seeded differently? Every rank now starts from rank 0's weights; call "
            "torch.manual_seed with one value on every rank before building the model, so that the rest of the "
            "script agrees too.", link.rank, len(differed), len(tensors), largest,
            ", ".join(name for name, _ in differed[:4]))
    return [name for name, _ in differed]


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, for the message (nan for integer buffers)."""
    return (a.double() - b.double()).abs().max().item() if a.is_floating_point() else float("nan")
