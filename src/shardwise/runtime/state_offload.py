"""`engine.offload_states()` / `engine.reload_states()`: DeepSpeed's API for freeing accelerator memory between
the phases of a run (RLHF: the actor's optimizer state while a rollout generates), and getting it back.

A state kind is DeepSpeed's `OffloadStateTypeEnum`; here each maps onto what the sharding strategy reports
holding (`ModelStateTensors`): `lp_params` the parameters as stored (stage 3: this rank's slices and the
resident whole copies; frozen parameters too), `hp_params` the fp32 masters, `lp_grads` the persistent
gradient storage, `optim_states` the optimizer's state tensors. `contiguous_grad_buffer` (DeepSpeed's reduce
scratch bucket) has no counterpart: the full gradient buffers of stages 2-3 live only during a backward.

Each storage on the accelerator is copied to host memory whole and its device memory freed by resizing the
storage to 0 bytes; reloading resizes it back and copies the bytes in. Every tensor that views the storage
(parameters, optimizer groups, bucket slices, autograd's saved views) keeps pointing at it, so nothing needs
re-linking and a reload restores the exact bytes. State already in host memory (offload_optimizer,
offload_param, a CPU run) stays where it is: offloading it to the CPU is done already.

A freed storage has no memory behind it, and a kernel reading it crashes (a segfault, an illegal address)
instead of raising: the engine refuses its own work that needs an offloaded kind (`check`). Memory that a kind
being offloaded shares with a kind that stays (fp32 training without offload_optimizer: the masters are the
parameters themselves) stays in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .. import accelerator

KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
"""DeepSpeed's OffloadStateTypeEnum values, in its order."""


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    host: torch.Tensor
    nbytes: int


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def kind_names(include: Iterable[Any] | None, caller: str) -> list[str]:
    """DeepSpeed's enum members or their strings, checked; None: every kind."""
    if include is None:
        return list(KINDS)
    if isinstance(include, (str, bytes)):
        include = [include]
    names = []
    for item in include:
        name = getattr(item, "value", item)
        if name not in KINDS:
            raise ValueError(f"{caller}: include: {item!r} is not a state kind; use OffloadStateTypeEnum members "
                             f"(deepspeed.runtime.zero.offload_config) or their names: {', '.join(KINDS)}.")
        names.append(name)
    return names


class StateParking:
    """The storages offload_states took off the accelerator, by kind, until reload_states puts them back."""

    def __init__(self) -> None:
        self._parked: dict[int, _Parked] = {}
        """By the storage's data pointer when it was parked (its identity: views share it)."""
        self.offloaded: dict[str, list[int]] = {}
        """Kind -> keys of `_parked` it holds (a storage two kinds share is parked once, under both)."""

    @staticmethod
    def movable(storage: torch.UntypedStorage) -> bool:
        """Only accelerator memory is offloaded: host memory is where offloading would put it."""
        return storage.device.type not in ("cpu", "meta")

    def offload(self, tensors: dict[str, list[torch.Tensor]], kinds: list[str], pin_memory: bool,
                non_blocking: bool) -> None:
        storages = {kind: _storages(ts) for kind, ts in tensors.items()}
        wanted = [k for k in kinds if k not in self.offloaded]
        # Memory a kind that stays shares (fp32 masters are the parameters) stays too: DeepSpeed's separate copy
        # that offloading would free does not exist here, so the footprint is already what it leaves.
        staying = {key for kind, found in storages.items() if kind not in wanted and kind not in self.offloaded
                   for key in found}
        device = None
        try:
            for kind in wanted:
                keys = []
                for key, storage in storages.get(kind, {}).items():
                    parkable = key not in staying and self.movable(storage) and storage.nbytes() > 0
                    if key not in self._parked and parkable:
                        self._parked[key] = _park(storage, pin_memory, non_blocking)
                        device = storage.device
                    if key in self._parked:
                        keys.append(key)
                self.offloaded[kind] = keys
        except BaseException:
            self.reload(non_blocking=False)  # all or nothing: a half-offloaded engine would pass `check`
            raise
        if device is not None:
            if not non_blocking:
                accelerator.synchronize(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # a rollout engine in another process needs the memory itself, not our cache

    def reload(self, non_blocking: bool) -> None:
        device = None
        for parked in self._parked.values():
            parked.storage.resize_(parked.nbytes)
            _as_bytes(parked.storage).copy_(parked.host, non_blocking=non_blocking)
            device = parked.storage.device
        self._parked.clear()
        self.offloaded.clear()
        if device is not None and not non_blocking:
            accelerator.synchronize(device)

    def check(self, caller: str, needs: Iterable[str] = KINDS) -> None:
        """Refuse `caller` while a kind of state it reads or writes is offloaded."""
        missing = [k for k in needs if self.offloaded.get(k)]
        if missing:
            raise RuntimeError(f"{caller}: the engine's {', '.join(missing)} were offloaded by "
                               "engine.offload_states() and are not in accelerator memory; call "
                               "engine.reload_states() first.")


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    found = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            found.setdefault(storage.data_ptr(), storage)
    return found


def _park(storage: torch.UntypedStorage, pin_memory: bool, non_blocking: bool) -> _Parked:
    pin = pin_memory and storage.device.type == "cuda"
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
    host.copy_(_as_bytes(storage), non_blocking=non_blocking and pin)
    nbytes = storage.nbytes()
    # The caching allocator orders the freed block after the copy on this stream; reload's copy back is queued on
    # the same stream after it.
    storage.resize_(0)
    return _Parked(storage, host, nbytes)


def state_tensors(strategy: Any, optimizer: torch.optim.Optimizer | None) -> dict[str, list[torch.Tensor]]:
    """What each kind of state is, in this engine (see the module docstring)."""
    held = strategy.model_state_tensors()
    optim = [] if optimizer is None else [v for state in optimizer.state.values() for v in state.values()
                                          if isinstance(v, torch.Tensor)]
    return {"optim_states": optim, "hp_params": list(held.masters), "lp_params": [*held.params, *held.frozen],
            "lp_grads": list(held.grads), "contiguous_grad_buffer": []}
