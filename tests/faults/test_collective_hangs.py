"""A collective that waits on a missing rank says which rank, early and at the timeout, over both transports.

Found by a probe: with the default collective_timeout_s of 1800, a rank stuck while its peer waited in a
collective printed nothing for 30 minutes, and the timeout then named only the waiting rank. Now a
collective still pending after `collective_warn_after_s` logs once which ranks have not arrived, and the
timeout (or a peer's exit) names them and where they last were. Each case runs over shared memory and over
gloo (SHARDWISE_SHM_COLLECTIVES=0), the two transports of a CPU job.
"""

from __future__ import annotations

import logging
import os
import re
import time

import pytest
import torch.distributed as dist

import shardwise
from shardwise.distributed import CollectiveError, CollectiveTimeout
from tests.harness import run_distributed
from tests.parity import ds_config, make_model, micro_batch, param_groups

TRANSPORTS = {"shm": "1", "gloo": "0"}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _engine(transport: str, timeout_s: float, warn_after_s: float):
    os.environ["SHARDWISE_SHM_COLLECTIVES"] = TRANSPORTS[transport]
    model = make_model()
    config = ds_config(2, 1, collective_timeout_s=timeout_s, collective_warn_after_s=warn_after_s)
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _step(engine, step: int) -> None:
    engine.backward(engine(*micro_batch(step, 0, dist.get_rank(), 2, 1, 2)))
    engine.step()


def _late_then_stuck(transport: str) -> dict:
    """Rank 1 comes 1.5 s late to a step (rank 0 warns, then completes), then never comes (rank 0 times out)."""
    engine = _engine(transport, timeout_s=4.0, warn_after_s=0.5)
    warnings = _Lines()  # from here: ranks may reach initialize's own exchange more than 0.5 s apart
    logging.getLogger("shardwise").addHandler(warnings)
    _step(engine, 0)
    if dist.get_rank() == 1:
        time.sleep(1.5)
    _step(engine, 1)  # completes on both ranks
    late = list(warnings.lines)
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:  # stuck, alive, until rank 0 has timed out
        deadline = time.monotonic() + 60
        while not store.check(["rank 0 timed out"]) and time.monotonic() < deadline:
            time.sleep(0.1)  # not a blocking store.wait: that would hold the store client its progress uses
        store.set("rank 1 saw it", "1")  # rank 0 hosts the store: it must not exit before this
        return {"late": late}
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as raised:
        _step(engine, 2)
    store.set("rank 0 timed out", "1")
    store.wait(["rank 1 saw it"])
    return {"late": late, "stuck": str(raised.value), "seconds": time.monotonic() - start,
            "warnings": warnings.lines[len(late):]}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_late_rank_is_named_early_and_a_stuck_one_at_the_timeout(transport: str) -> None:
    rank0, rank1 = run_distributed(_late_then_stuck, 2, transport, timeout=90)
    never = r"rank 1 never arrived \(rank 1 last re(ached|ported) call #\d+: (all_reduce|broadcast|all_gather)\)"
    # Late: rank 0 said which rank it waited for (once per collective) and finished the step.
    assert rank0["late"], "no early warning"
    for line in rank0["late"]:
        assert re.fullmatch(r"\[rank 0/2, data group\] \w+ of \(\d+,\) float32 \(call #\d+\) still waiting after "
                            r"0\.5 s: rank 1 has not arrived yet \(rank 1 last re(ached|ported) call #\d+: \w+\); "
                            r"waiting up to 4 s \(collective_timeout_s\) before failing", line), line
    assert len({re.search(r"call #\d+", line).group() for line in rank0["late"]}) == len(rank0["late"])
    assert rank1["late"] == []  # the late rank itself waited for nobody
    # Stuck: warned after 0.5 s, failed after the 4 s timeout, both naming rank 1.
    assert re.fullmatch(r"\[rank 0/2, data group\] \w+ of \(\d+,\) float32 \(call #\d+\) did not complete in 4 s: "
                        + never, rank0["stuck"]), rank0["stuck"]
    waited, last = (int(n) for n in re.findall(r"call #(\d+)", rank0["stuck"]))
    assert last == waited - 1  # where rank 1 stopped: the collective before
    assert any("rank 1 has not arrived yet" in line for line in rank0["warnings"])
    assert 3.5 < rank0["seconds"] < 30


def _peer_exits(transport: str) -> dict | None:
    engine = _engine(transport, timeout_s=60.0, warn_after_s=30.0)
    _step(engine, 0)
    if dist.get_rank() == 1:
        time.sleep(0.5)  # let its progress record settle, then exit while rank 0 goes on
        return None
    time.sleep(1.0)
    start = time.monotonic()
    with pytest.raises(CollectiveError) as raised:
        _step(engine, 1)
    return {"error": str(raised.value), "seconds": time.monotonic() - start}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_peer_that_exited_is_named_at_once_not_after_the_timeout(transport: str) -> None:
    rank0, _ = run_distributed(_peer_exits, 2, transport, timeout=90)
    assert re.search(r"rank 1 never arrived \(rank 1 exited( \(pid \d+\))?, last re(ached|ported) call #\d+: \w+\)",
                     rank0["error"]), rank0["error"]
    assert rank0["error"].startswith("[rank 0/2, data group] ")
    assert rank0["seconds"] < 20  # the 60 s timeout did not have to pass


def _one_rank_never_starts() -> str | None:
    """Rank 1 does not reach initialize (still loading data, say) until rank 0 has given up."""
    shardwise.init_distributed()
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        deadline = time.monotonic() + 60
        while not store.check(["rank 0 timed out"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        store.set("rank 1 saw it", "1")
        return None
    model = make_model()
    config = ds_config(2, 1, collective_timeout_s=2.0, collective_warn_after_s=0.0)
    with pytest.raises(CollectiveTimeout) as raised:
        shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    store.set("rank 0 timed out", "1")
    store.wait(["rank 1 saw it"])
    return str(raised.value)


def test_a_rank_that_never_reaches_initialize_is_named():
    message, _ = run_distributed(_one_rank_never_starts, 2, timeout=90)
    assert re.fullmatch(r"initialize, comparing every rank's config and model: \[rank 0/2, rank-agreement group\] "
                        r"all_gather of \(\d+,\) uint8 \(call #1\) did not complete in 2 s: rank 1 never arrived "
                        r"\(rank 1 has issued no collective on this group yet\)", message), message
