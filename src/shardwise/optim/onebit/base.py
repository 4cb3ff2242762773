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

from typing import Any, Callable, Iterable

import torch

from ...distributed import Collectives, Group
from .compressed_allreduce import CompressedAllReduce

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
        for key, flat in self.flat.items():
            for p, view in zip(self._params, self.views(flat)):
                state = self.state[p]
                if key in state and state[key].data_ptr() != view.data_ptr():
                    view.copy_(state[key])
                state[key] = view
        for p in self._params:
            self.state[p].setdefault("step", 0)

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
        """`flat` (laid out like the moments) becomes the ranks' compressed mean, zero where the variance is.

        [Note: compressing in Adam's units] What travels is `flat / sqrt(v)`, and the mean is multiplied back. The
        division is the same on every rank, so in exact arithmetic it changes nothing, but one block scale then fits
        every element of the block: a gradient or momentum of the raw model mixes parameters whose magnitudes differ
        by orders (an embedding next to a norm's bias), and a shared scale would hand the small ones steps of the big
        ones' size, divided by their small variance. DeepSpeed compresses raw values with one scale per tensor. An
        element whose variance is 0 sends and receives 0 ([Note: entries that never had a gradient]).
        """
        if self.allreduce is None:
            raise RuntimeError(f"{type(self).__name__}: it runs inside a shardwise engine (ZeRO stage 0), which "
                               "connects it to the data-parallel group; pass it to shardwise.initialize by config.")
        variance = self.flat["exp_avg_sq"]
        unseen = variance == 0
        scale = variance.sqrt().masked_fill_(unseen, 1.0)
        flat.div_(scale).masked_fill_(unseen, 0.0)
        self.allreduce(flat)
        flat.mul_(scale).masked_fill_(unseen, 0.0)

    def _grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        missing = [i for i, p in enumerate(params) if p.grad is None]
        if missing:
            raise RuntimeError(f"{type(self).__name__}: every parameter needs a gradient (the momentum is exchanged "
                               f"as one buffer); parameters {missing[:5]} of a group have none.")
        return [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]

    def _adam_moments(self, group: dict[str, Any], grads: list[torch.Tensor], variance: bool) -> None:
        """Adam's momentum (torch's lerp, as its AdamW) and, with `variance`, its variance, for `group`."""
        beta1, beta2 = group["betas"]
        torch._foreach_lerp_([self.state[p]["exp_avg"] for p in group["params"]], grads, 1 - beta1)
        if variance:
            variances = [self.state[p]["exp_avg_sq"] for p in group["params"]]
            torch._foreach_mul_(variances, beta2)
            torch._foreach_addcmul_(variances, grads, grads, value=1 - beta2)

    def _adam_denominators(self, group: dict[str, Any], variance_steps: int, hold_unseen: bool = True) -> list[torch.Tensor]:
        """`frozen_denominators` of `group` after `variance_steps` variance updates."""
        bias2 = 1 - group["betas"][1] ** variance_steps if group["bias_correction"] else 1.0
        return frozen_denominators([self.state[p]["exp_avg_sq"] for p in group["params"]], bias2, group["eps"],
                                   hold_unseen)

    @staticmethod
    def _adam_step_size(group: dict[str, Any], step: int) -> float:
        """lr over the momentum's bias correction."""
        return group["lr"] / (1 - group["betas"][0] ** step if group["bias_correction"] else 1.0)

    freeze_step: int
    """1-bit Adam and LAMB: the last step on exactly averaged gradients."""

    def reduces_gradients(self) -> bool:
        """Whether the next step needs exactly averaged gradients ([Note: who reduces what])."""
        return self.steps + 1 <= self.freeze_step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._take_step(self._advance())
        return loss

    def _take_step(self, step: int) -> None:
        """Step number `step` (1-based), every parameter having its gradient."""
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


def frozen_denominators(exp_avg_sqs: list[torch.Tensor], bias_correction2: float, eps: float,
                        hold_unseen: bool = True) -> list[torch.Tensor]:
    """Adam's sqrt(v / bias_correction2) + eps, per parameter, as new tensors; with `hold_unseen`, infinite where v is 0.

    [Note: entries that never had a gradient] 1 bit cannot say zero, so a compressed mean puts about its block's
    magnitude into every element, including those whose gradient has always been exactly zero (embedding rows of
    tokens not seen yet). Their variance is 0, so Adam would divide that by eps and throw the weight away; DeepSpeed
    asks for a hand-made `exp_avg_mask`. Here an element whose variance is exactly 0 takes no Adam step (an infinite
    denominator) and the compressed means are masked the same way, so it stays where it is until an exact step gives
    it a variance. Exact Adam is unchanged: there, v = 0 means m = 0, and 0 / eps = 0 / inf = 0.
    """
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, bias_correction2**0.5)
    torch._foreach_add_(denoms, eps)
    if hold_unseen:
        for denom, variance in zip(denoms, exp_avg_sqs):
            denom.masked_fill_(variance == 0, float("inf"))
    return denoms
