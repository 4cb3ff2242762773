"""What the communication-compressed optimizers share: flat state, the phase the strategy asks about, and
the state each rank keeps for itself.

[Note: who reduces what] ZeRO stage 0 (`zero/compressed_dp.py`) asks `reduces_gradients()` before each
step's backward. True: the gradients are averaged exactly, as for any optimizer (a warm-up step). False: the
backward reduces nothing and the optimizer's `step()` sees this rank's own gradients; it then averages what
it must itself, through `CompressedAllReduce`. Everything that decides the phase is a function of the step
count, which checkpoints keep, so a resumed run is in the same phase.

The moments live in one flat fp32 buffer per kind (the per-parameter state entries are views of it), so a
whole model's momentum is compressed in one exchange, not one per parameter.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from ...distributed import Collectives, Group
from .compressed_allreduce import CompressedAllReduce

logger = logging.getLogger(__name__)

_BACKENDS = ("nccl", "mpi", "gloo", "hccl", "compressed")


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of OneBitAdam, ZeroOneAdam and OneBitLamb: `flat_keys` name the flat moment buffers."""

    flat_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], cuda_aware: bool, comm_backend_name: str):
        super().__init__(params, defaults)
        if comm_backend_name not in _BACKENDS:
            raise ValueError(f"comm_backend_name: one of {', '.join(_BACKENDS)} is required; got {comm_backend_name!r}. "
                             "shardwise sends through the engine's process group whatever it names; drop the key.")
        del cuda_aware  # DeepSpeed's MPI switch: shardwise's collectives need no such promise
        self._params = [p for group in self.param_groups for p in group["params"]]
        if len({id(p) for p in self._params}) != len(self._params):
            raise ValueError(f"{type(self).__name__}: a parameter appears twice in the param groups; list each once.")
        self.numel = sum(p.numel() for p in self._params)
        device = self._params[0].device if self._params else torch.device("cpu")
        self.flat = {key: torch.zeros(self.numel, device=device) for key in self.flat_keys}
        self._point_state_at_flat()
        self.allreduce: CompressedAllReduce | None = None

    def _point_state_at_flat(self) -> None:
        """Make each parameter's state entries views of the flat buffers (keeping values already there)."""
        offset = 0
        for p in self._params:
            state = self.state[p]
            for key, flat in self.flat.items():
                view = flat[offset : offset + p.numel()].view_as(p)
                if key in state and state[key].data_ptr() != view.data_ptr():
                    view.copy_(state[key])
                state[key] = view
            state.setdefault("step", 0)
            offset += p.numel()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat buffer laid out like the moments (parameter-group order)."""
        out, offset = [], 0
        for p in self._params:
            out.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return out

    def groups(self) -> Iterable[tuple[dict[str, Any], slice]]:
        """Each param group with the slice of the parameter list (and of `views`) it covers."""
        start = 0
        for group in self.param_groups:
            yield group, slice(start, start + len(group["params"]))
            start += len(group["params"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._point_state_at_flat()  # torch's loader replaced the views with fresh tensors

    def connect(self, comm: Collectives, group: Group) -> None:
        """Send through `comm` over the data-parallel `group` (the strategy calls this once)."""
        self.allreduce = CompressedAllReduce(comm, group, self.numel, self.flat[self.flat_keys[0]].device)

    @property
    def steps(self) -> int:
        """Steps taken so far (the checkpointed per-parameter 'step')."""
        return int(self.state[self._params[0]]["step"]) if self._params else 0

    def _advance(self) -> int:
        step = self.steps + 1
        for p in self._params:
            self.state[p]["step"] = step
        return step

    def _compressed_mean(self, flat: torch.Tensor) -> None:
        if self.allreduce is None:
            raise RuntimeError(f"{type(self).__name__}: it runs inside a shardwise engine (ZeRO stage 0), which "
                               "connects it to the data-parallel group; pass it to shardwise.initialize by config.")
        self.allreduce(flat)

    def _grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        missing = [i for i, p in enumerate(params) if p.grad is None]
        if missing:
            raise RuntimeError(f"{type(self).__name__}: every parameter needs a gradient (the momentum is exchanged "
                               f"as one buffer); parameters {missing[:5]} of a group have none.")
        return [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]

    def reduces_gradients(self) -> bool:
        """Whether the next step needs exactly averaged gradients ([Note: who reduces what])."""
        raise NotImplementedError

    # What this rank alone holds, for checkpoints: tensors by name. `load_rank_local_state` receives this rank's
    # saved dict when the data-parallel layout is unchanged (else None, with rank 0's dict as `first`).
    def rank_local_state(self) -> dict[str, torch.Tensor]:
        if self.allreduce is None:
            return {}
        return {"worker_error": self.allreduce.worker_error, "server_error": self.allreduce.server_error}

    def load_rank_local_state(self, own: dict[str, torch.Tensor] | None, first: dict[str, torch.Tensor]) -> list[str]:
        """Restore what `rank_local_state` saved; returns what could not be restored (for one warning)."""
        if self.allreduce is None:
            return []
        if own is not None and "worker_error" in own and own["worker_error"].numel() == self.allreduce.padded:
            self.allreduce.worker_error.copy_(own["worker_error"])
            self.allreduce.server_error.copy_(own["server_error"])
            return []
        self.allreduce.reset_errors()
        return ["the compression errors (zeroed: they belong to the ranks that saved them)"]


def frozen_denominators(exp_avg_sqs: list[torch.Tensor], bias_correction2: float, eps: float) -> list[torch.Tensor]:
    """Adam's sqrt(v / bias_correction2) + eps, per parameter, as new tensors."""
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, bias_correction2**0.5)
    torch._foreach_add_(denoms, eps)
    return denoms
