"""Every `deepspeed.*` name DeepSpeedExamples and DeepSpeed-Chat use (tests/data/deepspeed_examples_names.json,
written by tools/deepspeed_names.py) has the fate the catalogue and docs/reference/deepspeed-names.md say: it works,
or it refuses with shardwise's NotSupportedError; and the two names the pipeline example needs behave as
DeepSpeed's do (RepeatingLoader, set_random_seed)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.unsupported import NotSupportedError
from tests.compat.run import deepspeed_python

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from deepspeed_names import CATALOGUE, PAGE, fate, main, names_in, page, resolve  # noqa: E402 - the tool wrote it

ENTRIES = json.loads(CATALOGUE.read_text())["names"]


@pytest.mark.parametrize("name", list(ENTRIES), ids=list(ENTRIES))
def test_each_name_has_its_catalogued_fate(name):
    entry = ENTRIES[name]
    what, why = fate(name)
    if entry["fate"] == "absent":  # DeepSpeed 0.19.8 lacks it too: it must stay an Import/AttributeError here
        assert what == "missing", f"{name}: catalogued as absent from DeepSpeed, but here it is {what}"
        return
    assert (what, why) == (entry["fate"], entry["why"]), "regenerate: python tools/deepspeed_names.py --write ..."
    if what == "refused":
        assert "not supported by shardwise" in why
        try:
            stand_in = resolve(name)
        except NotSupportedError:
            return
        with pytest.raises(NotSupportedError, match="not supported by shardwise"):
            stand_in(1, "two", three=3)  # whatever a script passes


def test_no_catalogued_name_is_missing():
    assert not [name for name, entry in ENTRIES.items() if entry["fate"] == "missing"]
    assert {"deepspeed.utils.RepeatingLoader", "deepspeed.runtime.utils.set_random_seed"} <= {
        name for name, entry in ENTRIES.items() if entry["fate"] == "works"}


def test_the_one_bit_optimizer_names_are_shardwises():
    """DeepSpeed 0.19.8 dropped these constants with its 1-bit optimizers; shardwise builds those optimizers, so
    bing_bert's `optimizer_name() == deepspeed.runtime.config.ONEBIT_LAMB_OPTIMIZER` can hold."""
    from deepspeed.runtime import config

    from shardwise.config.training import COMPRESSED_OPTIMIZER_NAMES

    names = (config.ONEBIT_ADAM_OPTIMIZER, config.ZERO_ONE_ADAM_OPTIMIZER, config.ONEBIT_LAMB_OPTIMIZER)
    assert names == COMPRESSED_OPTIMIZER_NAMES and set(names) <= set(config.DEEPSPEED_OPTIMIZERS)


def test_the_page_is_generated_from_the_catalogue():
    assert PAGE.read_text() == page(json.loads(CATALOGUE.read_text())), "regenerate with tools/deepspeed_names.py --write"


SCRIPT = """
import deepspeed
import deepspeed.comm as dist
from deepspeed import comm
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import RepeatingLoader as Loop
from deepspeed.runtime.zero import *
import torch.distributed as tdist

def f(args, engine):
    deepspeed.runtime.utils.set_random_seed(args.seed)
    dist.get_rank(); comm.barrier(); tdist.get_rank(); engine.backward(1)
    get_accelerator().device_name(); deepspeed.comm.ReduceOp.SUM
"""


def test_names_in_resolves_aliases_and_chains():
    assert names_in(SCRIPT) == {
        "deepspeed", "deepspeed.comm", "deepspeed.accelerator.get_accelerator", "deepspeed.utils.RepeatingLoader",
        "deepspeed.runtime.zero", "deepspeed.runtime.utils.set_random_seed", "deepspeed.comm.get_rank",
        "deepspeed.comm.barrier", "deepspeed.accelerator.get_accelerator().device_name", "deepspeed.comm.ReduceOp.SUM"}


def test_reads_a_git_dir(tmp_path, capsys):
    work = tmp_path / "work"
    (work / "training").mkdir(parents=True)
    (work / "training" / "train.py").write_text(SCRIPT)
    (work / "other.py").write_text("import deepspeed.moe.layer\n")
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run(git + args, check=True)
    assert main(["--git-dir", str(work / ".git"), "training"]) == 0
    out = capsys.readouterr().out
    assert "works    deepspeed.runtime.utils.set_random_seed  [1 file(s): training/train.py]" in out
    assert "moe" not in out  # outside the folder asked for


class CountingLoader:
    """A loader whose epochs are 3 items; counts how often it is restarted."""

    def __init__(self):
        self.starts = 0

    def __iter__(self):
        self.starts += 1
        return iter(range(3))


def test_repeating_loader_restarts_the_loader_when_it_is_exhausted():
    from deepspeed.runtime.dataloader import RepeatingLoader
    from deepspeed.utils import RepeatingLoader as FromUtils

    assert FromUtils is RepeatingLoader
    loader = CountingLoader()
    repeating = RepeatingLoader(loader)
    assert loader.starts == 1 and iter(repeating) is repeating  # DeepSpeed's starts the loader when built
    assert [next(repeating) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0] and loader.starts == 3
    torch_loader = torch.utils.data.DataLoader(torch.arange(4), batch_size=2)
    assert [b.tolist() for b, _ in zip(RepeatingLoader(torch_loader), range(5))] == [[0, 1], [2, 3]] * 2 + [[0, 1]]


def _draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


@pytest.mark.parametrize("seed", [0, 1138, 2**32 + 7, 2**63 + 11])
def test_set_random_seed_seeds_python_numpy_and_torch(seed):
    from deepspeed.runtime.utils import set_random_seed

    _draws()
    set_random_seed(seed)
    ours = _draws()
    random.seed(seed)
    np.random.seed(seed % 2**32)  # DeepSpeed reduces the seed to what numpy and torch accept
    torch.manual_seed(seed % 2**63)
    assert ours == _draws()


PARITY = """
import random, numpy as np, torch
from deepspeed.runtime.utils import set_random_seed
from deepspeed.utils import RepeatingLoader
out = []
for seed in (0, 1138, 2**32 + 7, 2**63 + 11):
    set_random_seed(seed)
    out.append([random.random(), float(np.random.rand()), float(torch.rand(1))])
it = RepeatingLoader(torch.utils.data.DataLoader(torch.arange(5), batch_size=2))
out.append([next(it).tolist() for _ in range(5)])
print(out)
"""


@pytest.mark.deepspeed_parity
@pytest.mark.skipif(deepspeed_python() is None, reason="needs the real DeepSpeed: make test-deepspeed")
def test_seeding_and_repeating_match_deepspeed():
    runs = [subprocess.run([python, "-c", PARITY], capture_output=True, text=True, timeout=300, check=True,
                           env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"}).stdout.splitlines()[-1]
            for python in (deepspeed_python(), sys.executable)]
    assert runs[0] == runs[1]


def test_deepspeed_utils_logging_leaves_the_standard_logging_alone(tmp_path):
    """`deepspeed.utils.logging` exists (bing_bert imports its logger) without a logging.py in deepspeed/utils, which
    would shadow the standard library's for `python .../deepspeed/utils/zero_to_fp32.py` (its folder heads sys.path)."""
    from deepspeed.utils.logging import log_dist, logger

    import deepspeed.utils
    from shardwise.monitor import console

    assert (logger, log_dist) == (console.logger, console.log_dist) and deepspeed.utils.logging.logger is logger
    script = Path(deepspeed.utils.__file__).with_name("zero_to_fp32.py")
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0 and "usage: zero_to_fp32" in done.stdout, done.stderr
