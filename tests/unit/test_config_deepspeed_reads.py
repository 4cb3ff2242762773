"""Which no-op DeepSpeed keys get a note: those DeepSpeed 0.19.8 would act on at the config's stage and offload
device (a note about a key that does nothing in DeepSpeed either is noise)."""

from __future__ import annotations

import pytest

from shardwise.config.compat import deepspeed_reads


@pytest.mark.parametrize("path, zero, reads", [
    ("zero_optimization.stage3_allgather_sequential", {"stage": 2}, False),
    ("zero_optimization.stage3_allgather_sequential", {"stage": 3}, True),
    ("zero_optimization.allgather_sequential", {"stage": 1}, False),  # DeepSpeed's other spelling of the key
    ("zero_optimization.leaf_module.classes", {"stage": 2}, False),  # inside a stage-3 section
    ("zero_optimization.reduce_scatter", {}, False),  # stage 0 (the default): no ZeRO optimizer
    ("zero_optimization.reduce_scatter", {"stage": 3}, True),
    ("zero_optimization.round_robin_gradients", {"stage": 3}, False),
    ("zero_optimization.allgather_partitions", {"stage": 2}, False),  # read by no code path
    ("zero_optimization.offload_optimizer.pipeline_read", {"stage": 3, "offload_optimizer": {"device": "cpu"}}, False),
    ("zero_optimization.offload_optimizer.pipeline_read", {"stage": 3, "offload_optimizer": {"device": "nvme"}}, True),
    ("zero_optimization.offload_optimizer.cpuadam_cores_perc", {"stage": 3, "offload_optimizer": {"device": "none"}},
     False),
    ("zero_optimization.offload_param.max_in_cpu", {"stage": 3, "offload_param": {"device": "nvme"}}, True),
    ("zero_optimization.stage3_allgather_sequential", {"stage": "three"}, True),  # unsure: validation refuses it
    ("timers.throughput.enabled", {}, True),  # not stage-bound
])
def test_deepspeed_reads(path, zero, reads):
    assert deepspeed_reads(path, {"zero_optimization": zero}) is reads
