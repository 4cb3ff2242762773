"""DeepSpeed's ZeRO-3 parameter attributes: `ds_id`, `ds_status`, `ds_numel`, `ds_shape`, `ds_tensor`.

[Note: the exception to "nothing is attached to nn.Parameter"] shardwise keeps a partitioned parameter's
state in side tables (`registry.py`). Code written for DeepSpeed reads it off the parameter instead, and
there is no way around that: DeepSpeed-Chat saves with `hasattr(p, "ds_id")` and `p.ds_status ==
ZeroParamStatus.NOT_AVAILABLE`, Hugging Face and peft size layers by `p.ds_shape` / `p.ds_numel` because a
partitioned parameter's data is an empty placeholder. So `mark_partitioned`, the only code that does it, moves
a partitioned parameter to a subclass of its own class whose `ds_*` names are read-only properties computed
from the side tables at every read:

- nothing is stored on the parameter, so no value can be stale: `ds_status` follows every gather and
  release (AVAILABLE when whole, INFLIGHT while its all-gather runs, NOT_AVAILABLE when partitioned);
- the attributes exist exactly while the parameter is in a side table (`hasattr(p, "ds_id")` is the test);
- a copy is an ordinary parameter of the original class without them: pickle and `torch.save` rebuild the
  parent class (loadable with `weights_only=True`), `copy.deepcopy` gives it back; `module.to()` keeps the
  parameter object and so its attributes.
"""

from __future__ import annotations

import enum
import functools
import itertools
from typing import Any

import torch

from .registry import DS_ID_OF, INIT_SHARD_OF, UNIT_OF, InitShard
from .unit import UnitState


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's `deepspeed.runtime.zero.partition_parameters.ZeroParamStatus` (same members and values)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_UNIT_STATUS = {UnitState.FULL: ZeroParamStatus.AVAILABLE, UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
                UnitState.SHARDED: ZeroParamStatus.NOT_AVAILABLE}

# Process-wide, as DeepSpeed's counter: ids must differ between every two partitioned parameters, whichever
# zero.Init or engine partitioned them (DeepSpeed's consolidation keys tied weights by ds_id).
_next_id = itertools.count()


def _owner(param: torch.Tensor, name: str) -> Any:
    owner = UNIT_OF.get(param)
    if owner is None:
        owner = INIT_SHARD_OF.get(param)
    if owner is None:
        raise AttributeError(f"{name}: the parameter is not partitioned by ZeRO-3 (any more)")
    return owner


class _DeepSpeedAttributes:
    """Mixed into the class of a partitioned parameter (see the note above). Adds no storage."""

    __slots__ = ()

    @property
    def ds_id(self) -> int:
        _owner(self, "ds_id")  # type: ignore[arg-type]
        return DS_ID_OF[self]

    @property
    def ds_status(self) -> ZeroParamStatus:
        owner = _owner(self, "ds_status")  # type: ignore[arg-type]
        if isinstance(owner, InitShard):
            return ZeroParamStatus.AVAILABLE if owner.gathered else ZeroParamStatus.NOT_AVAILABLE
        return _UNIT_STATUS[owner.state]

    @property
    def ds_shape(self) -> torch.Size:
        owner = _owner(self, "ds_shape")  # type: ignore[arg-type]
        return owner.shape if isinstance(owner, InitShard) else owner.whole_shape(self)

    @property
    def ds_numel(self) -> int:
        return self.ds_shape.numel()

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's partition of the parameter, as stored between uses."""
        owner = _owner(self, "ds_tensor")  # type: ignore[arg-type]
        return owner.shard if isinstance(owner, InitShard) else owner.local_part(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.nn.Parameter:
        original = type(self).__bases__[1]
        copied = original.__deepcopy__(self, memo)  # type: ignore[attr-defined]
        if type(copied) is type(self):
            copied.__class__ = original
        return copied


@functools.cache
def _with_attributes(cls: type) -> type:
    return type(f"Partitioned{cls.__name__}", (_DeepSpeedAttributes, cls), {"__module__": __name__})


def mark_partitioned(param: torch.nn.Parameter) -> None:
    """Give `param` (already in `UNIT_OF` or `INIT_SHARD_OF`) DeepSpeed's `ds_*` attributes; its `ds_id` is kept
    when the engine regroups a parameter that `zero.Init` partitioned."""
    if param not in DS_ID_OF:
        DS_ID_OF[param] = next(_next_id)
    if not isinstance(param, _DeepSpeedAttributes):
        param.__class__ = _with_attributes(type(param))
