"""tests/harness.py runs a multi-rank test once more only when its ranks could not connect over their port (another
test took it between choosing and binding it), never when the test itself failed."""

from __future__ import annotations

from tests.harness import _lost_rendezvous

# What a rank of test_pipeline_checkpoint.py said in CI on 2026-11-28 (abridged): the store it reached was another
# test's, whose agent had just been SIGKILLed.
LOST = """--- rank 1 failed ---
  File "torch/distributed/device_mesh.py", line 586, in _init_one_process_group
  File "torch/distributed/distributed_c10d.py", line 2169, in _new_process_group_helper
    backend_class = ProcessGroupGloo(
torch.distributed.DistNetworkError: Connection reset by peer"""
REFUSED = """--- rank 0 failed ---
  File "torch/distributed/distributed_c10d.py", in init_process_group
RuntimeError: [enforce fail at gloo/transport/tcp/pair.cc] connectFullMesh failed: Connection refused"""
FAILED_TEST = """--- rank 0 failed ---
  File "tests/distributed/test_x.py", line 9, in _train
AssertionError: loss 1.2 vs 1.3 (Connection refused appears only in a message)"""
BROKEN_MID_RUN = """--- rank 1 failed ---
  File "shardwise/distributed/collectives.py", line 80, in all_reduce
RuntimeError: [gloo] Connection reset by peer"""


def test_only_lost_rendezvous_is_retried():
    assert _lost_rendezvous(LOST) and _lost_rendezvous(REFUSED)
    assert not _lost_rendezvous(FAILED_TEST)  # the test's own failure
    assert not _lost_rendezvous(BROKEN_MID_RUN)  # a peer lost after setup: a real fault, reported
