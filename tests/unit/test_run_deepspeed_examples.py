"""tools/run_deepspeed_examples.py's own pieces (the runs themselves take minutes: the tool is run by hand, its result
in the notes): the loss lines of both implementations are read, nothing else is, and the config the runs get
departs from the example's only where the tool says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from run_deepspeed_examples import LOSS_LINE, SHIM, write_config  # noqa: E402 - a script, not a package

DEEPSPEED_OUTPUT = """\
[2026-11-28 11:11:19,188] [INFO] [launch.py:170:main] dist_world_size=2
stage=0 layers=19
steps: 1 loss: 2.3028 iter time (s): 7.490 samples/sec: 34.179
steps: 2 loss: 4.2417 iter time (s): 8.796 samples/sec: 29.106
[2026-11-28 11:13:38,432] [INFO] [launch.py:285:main] Process 4705 exits successfully.
"""
SHARDWISE_OUTPUT = """\
[shardwise] step 1 | loss 2.3024 | lr 1.000e-03 | loss scale 1 | grad norm 0.1265 | 18.8 samples/s | peak memory 1 MB
[shardwise] step 1 | time per step (ms) | forward 12.10 | backward 30.02
[shardwise] step 2 | loss 4.8782 | lr 1.000e-03 | loss scale 1 | grad norm 34.13 | 11.9 samples/s
[shardwise] step 2 | memory (MB) | parameters 12.0
"""


def test_loss_lines_of_both_implementations():
    assert LOSS_LINE.findall(DEEPSPEED_OUTPUT) == [("1", "2.3028"), ("2", "4.2417")]
    assert LOSS_LINE.findall(SHARDWISE_OUTPUT) == [("1", "2.3024"), ("2", "4.8782")]


def test_config_departs_only_where_said(tmp_path, capsys):
    example = {"train_batch_size": 256, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10,
               "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "wall_clock_breakdown": False}
    (tmp_path / "ds_config.json").write_text(json.dumps(example))
    assert write_config(tmp_path, True, []) == "ds_config.json"
    run = json.loads((tmp_path / write_config(tmp_path, False, [])).read_text())
    assert run == {**example, "steps_per_print": 1}
    run = json.loads((tmp_path / write_config(tmp_path, False, ["gradient_clipping=0"])).read_text())
    assert run == {**example, "steps_per_print": 1, "gradient_clipping": 0}
    assert "config: gradient_clipping = 0 (--set; the example's ds_config.json has 'gradient_clipping': '(unset)')" \
        in capsys.readouterr().out


def test_shim_swaps_the_data(tmp_path):
    """In a process of its own (the shim patches torch): CIFAR10 becomes fixed CIFAR-style (image, label) items that
    draw nothing from torch's global RNG (dropout's), and torch.cuda.set_device is harmless without CUDA. A stand-in
    torchvision: the real one is installed by the tool into a cache, not into the venv."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text("import types\ndatasets = types.SimpleNamespace()\n")
    (tmp_path / "sitecustomize.py").write_text(SHIM.replace("{count}", "16").replace("{size}", "64"))
    check = """
import torch, torchvision
state = torch.get_rng_state()
a = torchvision.datasets.CIFAR10(root="/nowhere", train=True, download=True, transform=object())
b = torchvision.datasets.CIFAR10(root="/elsewhere", train=True, download=True)
image, label = a[3]
assert torch.equal(torch.get_rng_state(), state)
assert len(a) == 16 and tuple(image.shape) == (3, 64, 64) and isinstance(label, int) and 0 <= label < 10
assert torch.equal(a.data, b.data) and torch.equal(a.targets, b.targets)
torch.cuda.set_device(0)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
