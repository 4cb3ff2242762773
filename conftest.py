import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test` runs on two pytest-xdist workers. A module's tests stay on one worker, in order, so its module-scoped
# oracles are computed once. The modules that build network-namespace hosts share one group: two of them at once
# start 8+ ranks whose gloo meshes time out connecting on a 2-core machine. That group starts first, so the
# longest chain of tests does not finish last.
HOST_MODULES = {"test_deepspeed_command_hosts", "test_multinode", "test_elastic", "test_finetune_launchers",
                "test_multinode_no_ssh", "test_node_local_hosts"}


def _group(item: pytest.Item) -> str:
    module = item.module.__name__ if item.module else item.nodeid.split("::")[0]
    return "hosts" if module.rsplit(".", 1)[-1] in HOST_MODULES else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {item: _group(item) for item in items}
    for item, group in groups.items():
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: groups[item] != "hosts")  # stable: every module keeps its order
