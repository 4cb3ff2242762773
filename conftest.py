import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test` runs on two pytest-xdist workers. A module's tests stay on one worker, in order, so its module-scoped
# oracles are computed once. The modules that build network-namespace hosts share one group: two of them at once
# start 8+ ranks whose gloo meshes time out connecting on a 2-core machine. That group starts first, so the
# longest chain of tests does not finish last.
HOST_MODULES = {"test_deepspeed_command_hosts", "test_multinode", "test_elastic", "test_finetune_launchers",
                "test_multinode_no_ssh", "test_node_local_hosts"}


def group_of(nodeid: str) -> str:
    """The unit of work one worker runs whole: a test file, or "hosts" for the namespace-host modules."""
    path = nodeid.split("::", 1)[0]
    return "hosts" if path.rsplit("/", 1)[-1].removesuffix(".py") in HOST_MODULES else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: group_of(item.nodeid) != "hosts")  # stable: every module keeps its order


class _GroupScheduling:
    """Schedules by `group_of`, not by xdist's @group suffix: xdist puts that suffix on a private attribute that
    pytest 9 no longer reads for the node id, so with it every test was its own group, a module ran on both
    workers and its module-scoped oracles were computed twice."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN205 (xdist's Scheduling protocol)
        from xdist.scheduler import LoadScopeScheduling

        class ByGroup(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid)

        return ByGroup(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):  # the hook exists only where xdist is loaded (-p no:xdist)
        config.pluginmanager.register(_GroupScheduling(), "shardwise-group-scheduling")


# Variables a library sets once for the rest of the process, not a test's doing: pytest's own (per phase), and torch
# inductor's cache folder and the address its compiled kernels read at load (undoing that breaks the next one loaded).
PROCESS_OWNED_VARIABLES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_")


def _process_settings() -> dict[str, object]:
    """What else a test could change for every later test of its worker: the working folder, and torch's default
    dtype and intra-op threads (once torch is imported; importing it here would cost every unit test)."""
    settings: dict[str, object] = {"working folder": os.getcwd()}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_default_dtype"):
        settings.update({"torch default dtype": torch.get_default_dtype(), "torch threads": torch.get_num_threads()})
    return settings


@pytest.fixture(autouse=True)
def _environment_unchanged():
    """Every test leaves os.environ (and `_process_settings`) as it found them. The tests of one worker share one
    process: a variable a test leaves behind reaches every later test and the processes they start
    (GLOO_SOCKET_IFNAME=lo, left by an in-process launch, made later multi-node ranks announce 127.0.0.1 to their
    peers on other hosts). Set up before any fixture a test asks for, so this runs after monkeypatch has undone its
    changes."""
    before, settings = dict(os.environ), _process_settings()
    yield
    changed = sorted(k for k in before.keys() | os.environ.keys()
                     if before.get(k) != os.environ.get(k) and not k.startswith(PROCESS_OWNED_VARIABLES))
    for key in changed:  # the next tests run in the environment they expect
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]
    after = _process_settings()
    moved = {name: (value, after[name]) for name, value in settings.items() if after.get(name, value) != value}
    if moved:
        _restore_settings(settings)
    if changed or moved:
        pytest.fail(f"the test left its worker changed: os.environ {changed}, {moved}. Use monkeypatch "
                    "(setenv/delenv/chdir; setenv before a delenv of a variable that may be absent, whose delenv "
                    "records nothing to undo) or restore it in a finally.")


def _restore_settings(settings: dict[str, object]) -> None:
    os.chdir(settings["working folder"])
    if "torch default dtype" in settings:
        torch = sys.modules["torch"]
        torch.set_default_dtype(settings["torch default dtype"])
        torch.set_num_threads(settings["torch threads"])


@pytest.fixture
def zygote_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shardwise launches of this test fork their ranks from a pre-imported interpreter (tests/rank_zygote.py):
    ~3 CPU-s of imports saved per rank. For tests of training through the launcher, not of its processes (signals,
    parents, process groups) or of ranks in network-namespace hosts; a module opts in with
    ``pytestmark = pytest.mark.usefixtures("zygote_ranks")``."""
    from tests.rank_zygote import routing

    for name, value in routing().items():
        monkeypatch.setenv(name, value)
