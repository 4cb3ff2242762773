"""What the engine says when a rank runs out of memory: what was live, what the plan of this config expected,
and config changes that would fit, each with its planned peak (see [Note: explaining an out-of-memory]).

[Note: explaining an out-of-memory] The capacity a config must fit in is what was live at the failure plus
what could still be allocated (`accelerator.memory_headroom`; runtime/out_of_memory.py says how "live" is
counted). Changes are planned with the activations of the first forward, measured when it finished, else
estimated from what it saved before it failed, stretched to the modules it had not reached. A change fits
when its planned peak is within `FIT_SHARE` of the capacity: the rest is left for what no plan counts
(fragmentation, temporaries of single ops, tensors the training loop keeps). Under an address-space rlimit it must
also leave `outside_allocator` free, since that limit counts mappings no plan knows of.

[Note: one account for the failure and the proposals] The failure is judged by the allocator: at the failure
the run needed more than the capacity. The plan counts less than the allocator does (the temporaries of the op
that failed and of its neighbours, the allocator's own slack), and a first forward's activations stretched from
the modules it reached can read low, so a change judged by the bare plan can fail again under the same limit.
So the plans are put on the failure's account: where the plan's account of the failing moment held `accounted`
bytes (the model states and buffers held plus the activations saved so far, when a first forward failed;
else the plan's peak of the failing config), the run needed at least capacity / accounted times its plan, and
every plan is scaled by that ratio (at least 1) before it is judged. Where that account already exceeded the
capacity, the ratio is 1 and the plans stand as they are.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from ..config import Config
from ..profiling.memory import MemoryBreakdown
from ..profiling.units import binary_bytes
from .changes import Change, parsed, single_changes
from .plan import MemoryPlan, plan
from .shape import ActivationProfile, ModelShape

FIT_SHARE = 0.9
SHOWN = 4


@dataclass(frozen=True)
class MemoryAtFailure:
    """What the runtime knows when an allocation fails on a rank."""

    where: str
    """"forward of micro-step 7 (step 3)", say."""
    rank: int
    device: str
    held: MemoryBreakdown
    live: int
    """Bytes allocated at the failure, less `other_engines` (see the note)."""
    headroom: int
    bound_by: str
    """What limits the headroom ("free on the device plus torch's unused cache", ...)."""
    activations: ActivationProfile | None
    """Saved bytes of one forward at the config's micro-batch; None when no forward got far enough to say."""
    activations_source: str
    """How `activations` was found: "measured over a whole forward", or how it was estimated."""
    on_cpu: bool
    host_capacity: int | None = None
    """Off CPU: host memory this rank may fill (its share of the available memory, plus what it holds)."""
    other_engines: int = 0
    """Device bytes the process's other engines hold there, which no change to this engine's config frees."""
    outside_allocator: int = 0
    """Of the capacity, what must stay free for mappings the allocator does not make (an address-space rlimit:
    `accelerator.ADDRESS_SPACE_OUTSIDE_ALLOCATOR`)."""
    accounted: int | None = None
    """What the plan's account held at the failure, when the runtime can say: a first forward that failed part-way
    (model states and buffers held, plus the activations saved so far). None: the plan's peak of the config stands
    for it (see [Note: one account for the failure and the proposals])."""

    @property
    def capacity(self) -> int:
        return self.live + self.headroom


@dataclass(frozen=True)
class Explanation:
    text: str
    fitting: tuple[tuple[Change, int], ...]
    """The changes shown as fitting, each with its planned peak per rank (bytes)."""
    scale: float = 1.0
    """The factor the plans were scaled by to be judged on the failure's account (see the note)."""


def explain(error: BaseException, facts: MemoryAtFailure, cfg: Config, dp_size: int, shape: ModelShape) -> Explanation:
    lines = [f"[rank {facts.rank}] out of memory on {facts.device} in the {facts.where}: {_first_line(error)}",
             facts.held.table()]
    if facts.activations is None:
        lines.append("activations: unknown (the failure came before the first forward saved any); the plans below "
                     "count model states only.")
    else:
        lines.append(f"activations: {binary_bytes(facts.activations.saved_bytes)} for a micro-batch of "
                     f"{facts.activations.micro_batch} ({facts.activations_source})")
    current = plan(shape, cfg, dp_size, facts.activations)
    scale = failure_scale(current, facts)
    lines += [current.table(f"The plan of this config: {binary_bytes(_peak(current, facts))} per rank"),
              f"Capacity: {binary_bytes(facts.capacity)} per rank ({binary_bytes(facts.live)} live at the failure + "
              f"{binary_bytes(facts.headroom)} still free, bound by {facts.bound_by}"
              + (f"; the {binary_bytes(facts.other_engines)} other engines hold on this device is left out"
                 if facts.other_engines else "")
              + f"); a config fits when its planned peak is within {FIT_SHARE:.0%} of it"
              + (f" and leaves {binary_bytes(facts.outside_allocator)} of it for mappings outside the tensor allocator "
                 "(an address-space limit counts them all: malloc arenas, oneDNN's kernels)" if facts.outside_allocator
                 else "") + "."]
    if _fits(current, facts, 1.0):
        lines.append("The plan fits, so the memory went to something the planner does not count: tensors the model or "
                     "the training loop keeps (a large logits tensor, cached outputs), or other processes on the device.")
    if scale > 1:
        what = ("the model states held and what the failing first forward had saved" if facts.accounted is not None
                else "the plan's peak of this config")
        lines.append(f"The run ran out of memory where its plan counts {binary_bytes(_accounted(current, facts))} "
                     f"({what}): it needed at least {scale:.2f} times its plan, so each plan below is scaled by "
                     f"{scale:.2f} before it is judged.")
    fitting = tuple(itertools.islice(changes_that_fit(cfg, dp_size, shape, facts), SHOWN))
    if fitting:
        lines.append("Changes that fit (planned peak per rank):")
        lines += [f"  - {change.description}: {binary_bytes(peak)}"
                  + (f" ({binary_bytes(int(peak * scale))} scaled by {scale:.2f})" if scale > 1 else "")
                  for change, peak in fitting]
        lines.append("`shardwise autotune` measures which of them runs fastest.")
    else:
        lines.append(_nothing_fits(cfg, dp_size, shape, facts, scale))
    return Explanation("\n".join(lines), fitting, scale)


def failure_scale(current: MemoryPlan, facts: MemoryAtFailure) -> float:
    """How many times its plan the failed run needed, at least (see [Note: one account for the failure and the
    proposals]); 1 where the plan already said the config would not fit."""
    accounted = _accounted(current, facts)
    return max(1.0, facts.capacity / accounted) if accounted > 0 else 1.0


def _accounted(current: MemoryPlan, facts: MemoryAtFailure) -> int:
    return facts.accounted if facts.accounted is not None else _peak(current, facts)


def changes_that_fit(cfg: Config, dp_size: int, shape: ModelShape, facts: MemoryAtFailure) -> Iterator[tuple[Change, int]]:
    """Single changes that fit by the failure's account, in `single_changes`' order; then pairs of them."""
    scale = failure_scale(plan(shape, cfg, dp_size, facts.activations), facts)
    singles = list(single_changes(cfg, dp_size))
    pairs = (a + b for a, b in itertools.combinations(singles, 2) if not set(a.overrides) & set(b.overrides))
    seen: set[tuple[tuple[str, object], ...]] = set()
    for change in itertools.chain(singles, pairs):
        key = tuple(sorted(change.overrides.items()))
        changed = parsed(cfg._raw, change, dp_size) if key not in seen else None
        seen.add(key)
        if changed is None:
            continue
        planned = plan(shape, changed, dp_size, facts.activations)
        if _fits(planned, facts, scale):
            yield change, _peak(planned, facts)


def _nothing_fits(cfg: Config, dp_size: int, shape: ModelShape, facts: MemoryAtFailure, scale: float) -> str:
    smallest = Change({"zero_optimization.stage": 3, "train_micro_batch_size_per_gpu": 1,
                       "gradient_accumulation_steps": cfg.gradient_accumulation_steps}, "")
    raw = {k: v for k, v in cfg._raw.items() if k != "train_batch_size"}  # the global batch grows with the ranks
    for ranks in (dp_size * 2**k for k in range(1, 7)):
        changed = parsed(raw, smallest, ranks)
        if changed is None:
            break
        sharded = plan(shape, changed, ranks, facts.activations)
        if _fits(sharded, facts, scale):
            return (f"No single change or pair of changes fits. At ZeRO stage 3 with a micro-batch of 1 over {ranks} "
                    f"ranks the plan is {binary_bytes(_peak(sharded, facts))} per rank"
                    + (f" ({binary_bytes(int(_peak(sharded, facts) * scale))} scaled by {scale:.2f})" if scale > 1 else "")
                    + ": add ranks, or a device with more memory.")
    return ("No change fits, not even ZeRO stage 3 with a micro-batch of 1 over 64 times the ranks: the model needs a "
            "device with more memory, tensor or pipeline parallelism, or a smaller model.")


def _fits(memory: MemoryPlan, facts: MemoryAtFailure, scale: float) -> bool:
    """Within `FIT_SHARE` of the capacity once scaled to the failure's account; the host's share (off CPU) is not
    what failed, so it is judged by the plan."""
    host_fits = facts.host_capacity is None or memory.peak_host <= FIT_SHARE * facts.host_capacity
    room = min(FIT_SHARE * facts.capacity, facts.capacity - facts.outside_allocator)
    return _peak(memory, facts) * scale <= room and host_fits


def _peak(memory: MemoryPlan, facts: MemoryAtFailure) -> int:
    """On CPU the device and host parts share one memory."""
    return memory.peak_total if facts.on_cpu else memory.peak_device


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
