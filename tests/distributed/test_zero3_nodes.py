"""ZeRO-3 across nodes: frozen weights kept node-local, and ZeRO++'s secondary partition (hpZ).

Nodes are simulated on one machine with `SHARDWISE_NODE` (what tells nodes apart when the hostname does not).
Both features change where weights travel, not what is computed: the runs must equal the single-process
oracle (fp32, 1e-5), and the traffic must move from the data group to the node's groups.
"""

from __future__ import annotations

import os

import pytest

from tests.harness import run_distributed
from tests.parity import assert_close_run, ds_config, engine_run, make_model, oracle, param_groups, train_steps

STEPS, MICRO, ACCUM = 3, 2, 2


def _config(**zero):
    return ds_config(MICRO, ACCUM, clip=0.5, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0, **zero})


def _on_nodes(ranks_per_node: int, config: dict):
    os.environ["SHARDWISE_NODE"] = f"node{int(os.environ['RANK']) // ranks_per_node}"
    losses, params, engine = engine_run(config, STEPS)
    stats = engine.comm.stats
    frozen = [u for u in engine.strategy.units if u.master is None]
    return {"losses": losses, "params": params,
            "gathered": {g: stats.elements("all_gather", g) for g in ("data", "node", "hpz")},
            "frozen_groups": sorted({(u.group.name, u.group.size) for u in frozen}),
            "replicas": sorted({u.replica for u in frozen}),
            "trainable_numel": sum(u.numel for u in engine.strategy.trainable),
            "frozen_numel_on_data": sum(u.numel for u in frozen if u.group.name == "data"),
            "frozen_bytes": engine.memory_breakdown().frozen_parameters.total}


@pytest.mark.parametrize("ranks_per_node", [1, 2])
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_frozen_weights_stay_on_their_node_and_train_like_the_oracle(ranks_per_node, offload):
    ref_losses, ref_params = oracle(STEPS, MICRO * ACCUM * 4, clip=0.5)
    config = _config(offload_param={"device": offload})
    local = run_distributed(_on_nodes, 4, ranks_per_node, config)
    spread = run_distributed(_on_nodes, 4, ranks_per_node, _config(offload_param={"device": offload},
                                                                   node_local_frozen_weights=False))
    for rank, (mine, plain) in enumerate(zip(local, spread)):
        assert_close_run(mine["losses"], mine["params"], ref_losses, ref_params, rtol=1e-5)
        assert mine["frozen_groups"] == [("node", ranks_per_node)]
        assert mine["replicas"] == [rank // ranks_per_node]
        assert plain["frozen_groups"] == [("data", 4)] and plain["gathered"]["node"] == 0
        # the memory account shows the cost: this rank's part of one node's copy, not of the whole group's
        frozen_numel = sum(p.numel() for p in make_model().frozen.parameters())
        assert mine["frozen_bytes"] == pytest.approx(frozen_numel * 4 / ranks_per_node, abs=16)
        assert plain["frozen_bytes"] == pytest.approx(frozen_numel * 4 / 4, abs=16)
        # What the data group no longer gathers is exactly what the node gathers instead (up to padding); a node of
        # one rank that keeps its copy on the device reads it in place ([Note: a unit of one]) and gathers nothing.
        moved = plain["gathered"]["data"] - mine["gathered"]["data"]
        if ranks_per_node == 1 and offload == "none":
            assert mine["gathered"]["node"] == 0 and moved > 0
        else:
            assert mine["gathered"]["node"] > 0 and abs(moved - mine["gathered"]["node"]) <= 4 * 4 * STEPS * ACCUM


def test_one_node_changes_nothing():
    local = run_distributed(_on_nodes, 2, 2, _config())
    assert all(r["frozen_groups"] == [("data", 2)] and r["gathered"]["node"] == 0 for r in local)


def _save_on_nodes(root: str):
    os.environ["SHARDWISE_NODE"] = f"node{int(os.environ['RANK']) // 2}"
    _, _, engine = engine_run(_config(), STEPS)
    engine.save_checkpoint(root, tag="nodes")
    return train_steps(engine, STEPS, 2)


def _resume_on_one_node(root: str, stage: int):
    import shardwise

    model = make_model()
    config = ds_config(MICRO, ACCUM * 2, clip=0.5, zero_optimization={"stage": stage})
    engine, *_ = shardwise.initialize(model=model, model_parameters=param_groups(model), config=config)
    engine.load_checkpoint(root, tag="nodes")
    return train_steps(engine, STEPS, 2)


@pytest.mark.parametrize("stage", [3, 1])
def test_node_local_checkpoint_resumes_on_one_node(tmp_path, stage):
    uninterrupted = run_distributed(_save_on_nodes, 4, str(tmp_path))[0]
    resumed = run_distributed(_resume_on_one_node, 2, str(tmp_path), stage)[0]
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)


@pytest.mark.parametrize("ranks_per_node", [2, 4])
def test_hpz_gathers_after_the_forward_within_the_node(ranks_per_node):
    ref_losses, ref_params = oracle(STEPS, MICRO * ACCUM * 4, clip=0.5)
    hpz = run_distributed(_on_nodes, 4, ranks_per_node, _config(zero_hpz_partition_size=ranks_per_node))
    plain = run_distributed(_on_nodes, 4, ranks_per_node, _config())
    for mine, base in zip(hpz, plain):
        assert_close_run(mine["losses"], mine["params"], ref_losses, ref_params, rtol=1e-5)
        assert mine["gathered"]["hpz"] > 0
        # Only the first gather of each step crosses the data group (and the whole-weights gather at the end);
        # the backward's and the second micro-step's come from the node's secondary partition. Frozen weights
        # (when not node-local: one node) cross it once, and again for the whole weights.
        assert mine["gathered"]["data"] == mine["trainable_numel"] * (STEPS + 1) + mine["frozen_numel_on_data"] * 2
        assert base["gathered"]["data"] >= 2 * mine["trainable_numel"] * STEPS


def _hpz_refused(size: int, ranks_per_node: int):
    os.environ["SHARDWISE_NODE"] = f"node{int(os.environ['RANK']) // ranks_per_node}"
    with pytest.raises(ValueError) as refused:
        engine_run(_config(zero_hpz_partition_size=size), 1)
    return str(refused.value)


def test_hpz_refuses_partitions_across_nodes_or_uneven():
    across = run_distributed(_hpz_refused, 4, 4, 2)
    assert all(m == across[0] for m in across)
    assert across[0] == ("zero_optimization.zero_hpz_partition_size: 4 puts ranks [0, 1, 2, 3] of nodes ['node0', "
                         "'node1'] in one secondary partition, whose backward all-gathers would cross nodes; set it to "
                         "the number of data-parallel ranks per node (at most 2), or 1 to turn it off.")
    uneven = run_distributed(_hpz_refused, 4, 3, 4)[0]
    assert uneven == ("zero_optimization.zero_hpz_partition_size: must divide the data-parallel size (4); got 3. "
                      "Set it to the number of data-parallel ranks per node.")
