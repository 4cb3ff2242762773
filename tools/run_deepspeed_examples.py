"""Run DeepSpeedExamples' pipeline example (training/pipeline_parallelism/train.py) unchanged on this machine's CPUs,
under shardwise's `deepspeed` and under the real DeepSpeed, and compare the losses each prints.

    python tools/run_deepspeed_examples.py                       # both, 2 ranks (2 pipeline stages), 3 steps
    python tools/run_deepspeed_examples.py --steps 10 --own-config   # the config byte for byte (one line, step 10)
    python tools/run_deepspeed_examples.py --only shardwise --keep /tmp/pipe-example

The example's train.py is taken from the mirrored DeepSpeedExamples git dir as it is. What differs from
`deepspeed train.py --deepspeed_config=ds_config.json -p 2 --steps=200` (its run.sh), and why:
- the data: CIFAR-10 cannot be downloaded here, so `torchvision.datasets.CIFAR10` is a fixed synthetic set of
  3x64x64 images with a class-dependent pattern (learnable, so the losses move). It ignores the example's
  transform, whose Resize(256)/CenterCrop(224) would cost AlexNet's convolutions 12x as much; 64 is about the
  smallest size AlexNet's feature stack takes (it needs at least 63).
- the device: `--backend gloo` (an argument the example has) instead of nccl, and `torch.cuda.set_device` a
  no-op where torch has no CUDA (the example calls it unconditionally; on a CPU build it raises).
- torchvision: PyPI's wheel matching the installed torch is built against CUDA torch, so its C++ ops (nms,
  roi_align: nothing AlexNet uses) cannot load on a CPU torch, and the import then fails registering their
  fake kernels; those two registration modules are stubbed.
- `steps_per_print`: 1 instead of 10, so that every step's loss is printed (`--own-config` keeps 10).
  DeepSpeed's pipeline engine prints the loss of the step it prints at, shardwise's console the mean over the
  interval since its last line; at 1 both are that step's loss.
All of this is in a shim (`sitecustomize.py`, first on PYTHONPATH in every rank); train.py is not edited.
torchvision and Pillow are installed with pip (no dependencies) into a cache folder shared by both venvs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardwise.distributed.env import free_port

ROOT = Path(__file__).resolve().parents[1]
MIRROR = Path("/work/.mirror/deepspeedai+DeepSpeedExamples/repo")
EXAMPLE = "training/pipeline_parallelism"
VENVS = {"shardwise": ROOT / ".venv", "deepspeed": ROOT / ".dsvenv"}
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardwise-examples"
# Both implementations print a step's loss with four decimals: DeepSpeed's "steps: 3 loss: 2.3017 iter time ...",
# shardwise's "[shardwise] step 3 | loss 2.3017 | lr ...".
LOSS_LINE = re.compile(r"\bsteps?:? (\d+) (?:\| )?loss:? ([0-9.eE+-]+|nan|inf)")

SHIM = '''\
"""Swaps written by tools/run_deepspeed_examples.py (see its docstring): the data, CUDA-only calls, torchvision's
CUDA-built op registrations. Loaded by every rank because it is first on PYTHONPATH."""
import sys
import types

for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules[_name] = types.ModuleType(_name)  # they register ops of the CUDA-built _C.so, absent on CPU torch

import torch
import torchvision


class FakeCIFAR10(torch.utils.data.Dataset):
    """CIFAR10's constructor and (image, label) items; fixed data made from its own generator, so that it is the
    same on every rank and in every run and draws nothing from torch's global RNG (dropout's)."""

    def __init__(self, root=None, train=True, transform=None, target_transform=None, download=False):
        generator = torch.Generator().manual_seed(0 if train else 1)
        count, size = {count}, {size}
        self.targets = torch.randint(0, 10, (count,), generator=generator)
        patterns = torch.randn(10, 3, size, size, generator=generator)
        noise = torch.randn(count, 3, size, size, generator=generator)
        self.data = 0.5 * patterns[self.targets] + noise

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.data[index], int(self.targets[index])


torchvision.datasets.CIFAR10 = FakeCIFAR10

if not torch.cuda.is_available():
    torch.cuda.set_device = lambda device: None
'''


def torch_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import torch; print(torch.__version__.split('+')[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def install_torchvision(torch_ver: str) -> Path:
    """torchvision for this torch (its minor is torch's + 15) and Pillow, without dependencies, into a cache
    folder; both venvs run the same Python and torch, so one folder serves both."""
    major, minor = (int(x) for x in torch_ver.split(".")[:2])
    if major != 2:
        raise SystemExit(f"torch {torch_ver}: this script knows torchvision's version only for torch 2.x")
    target = CACHE / f"torchvision-for-torch-{torch_ver}"
    if (target / "torchvision").is_dir() and (target / "PIL").is_dir():
        return target
    print(f"installing torchvision 0.{minor + 15}.* and Pillow into {target}", flush=True)
    subprocess.run([str(VENVS["shardwise"] / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(target), f"torchvision==0.{minor + 15}.*", "pillow"], check=True)
    return target


def extract_example(git_dir: Path, into: Path) -> None:
    for name in ("train.py", "ds_config.json"):
        blob = subprocess.run(["git", "--git-dir", str(git_dir), "show", f"HEAD:{EXAMPLE}/{name}"],
                              check=True, capture_output=True).stdout
        (into / name).write_bytes(blob)


def write_config(work: Path, own_config: bool, overrides: list[str]) -> str:
    """The config file the runs read: the example's own with `--own-config`, else a copy with steps_per_print 1 and
    any `--set KEY=JSON` (each one printed, as a departure from the example)."""
    if own_config and not overrides:
        return "ds_config.json"
    config = json.loads((work / "ds_config.json").read_text())
    if not own_config:
        config["steps_per_print"] = 1
    for item in overrides:
        key, _, value = item.partition("=")
        config[key] = json.loads(value)
        print(f"config: {key} = {config[key]!r} (--set; the example's ds_config.json has {key!r}: "
              f"{json.loads((work / 'ds_config.json').read_text()).get(key, '(unset)')!r})", flush=True)
    (work / "ds_config.run.json").write_text(json.dumps(config, indent=2))
    return "ds_config.run.json"


def run_one(name: str, work: Path, shim: Path, torchvision_dir: Path, config: str, steps: int, ranks: int,
            timeout: float) -> tuple[dict[int, float], str, float]:
    env = dict(os.environ)
    # DeepSpeed compiles its CPU ops (shm comm, fused Adam) on first use; a folder of our own keeps them built, where
    # the shared one is rebuilt whenever another DeepSpeed install builds there with other paths.
    env.update(PYTHONPATH=os.pathsep.join([str(shim), str(torchvision_dir)]), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{VENVS[name] / 'bin'}{os.pathsep}{env['PATH']}",
               TORCH_EXTENSIONS_DIR=str(CACHE / "torch_extensions"))
    command = [str(VENVS[name] / "bin" / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()),
               "train.py", f"--deepspeed_config={config}", "-p", str(ranks), f"--steps={steps}", "--backend", "gloo"]
    print(f"[{name}] {' '.join(command)}", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise SystemExit(f"[{name}] timed out after {timeout:.0f} s; its output:\n{output[-4000:]}") from None
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    (work / f"{name}.log").write_text(output)
    if done.returncode:
        raise SystemExit(f"[{name}] failed (exit {done.returncode}); the end of its output:\n{output[-6000:]}")
    losses = {int(step): float(loss) for step, loss in LOSS_LINE.findall(output)}
    return losses, output, seconds


def compare(results: dict[str, dict[int, float]]) -> float:
    ours, theirs = results["shardwise"], results["deepspeed"]
    if set(ours) != set(theirs) or not ours:
        raise SystemExit(f"the runs printed losses at different steps: shardwise {sorted(ours)}, "
                         f"DeepSpeed {sorted(theirs)}")
    worst = 0.0
    print(f"{'step':>5} {'shardwise':>10} {'DeepSpeed':>10} {'rel diff':>9}")
    for step in sorted(ours):
        rel = abs(ours[step] - theirs[step]) / max(abs(theirs[step]), 1e-12)
        worst = max(worst, rel)
        print(f"{step:>5} {ours[step]:>10.4f} {theirs[step]:>10.4f} {rel:>9.2e}")
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git-dir", type=Path, default=MIRROR, help="DeepSpeedExamples' (bare) git dir")
    parser.add_argument("--steps", type=int, default=3,
                        help="optimizer steps, each 32 micro-batches of 8 (with 512 samples step 3 starts epoch 2)")
    parser.add_argument("--samples", type=int, default=512, help="size of the synthetic training set")
    parser.add_argument("--image-size", type=int, default=64, help="side of the synthetic images (>= 63)")
    parser.add_argument("--only", choices=sorted(VENVS), help="run one implementation, compare nothing")
    parser.add_argument("--own-config", action="store_true", help="the example's ds_config.json byte for byte")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="change a top-level config key (e.g. gradient_clipping=0), said in the output")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max relative loss difference accepted")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (train.py, logs)")
    args = parser.parse_args()
    if args.image_size < 63:
        parser.error("--image-size: AlexNet's feature stack needs images of at least 63x63")
    for item in args.set:
        key, equals, value = item.partition("=")
        try:
            json.loads(value)
        except json.JSONDecodeError:
            equals = ""
        if not (key and equals):
            parser.error(f"--set {item!r}: write KEY=JSON, e.g. gradient_clipping=0 or 'fp16={{\"enabled\": true}}'")

    versions = {name: torch_version(venv / "bin" / "python") for name, venv in VENVS.items()}
    if len(set(versions.values())) != 1:
        raise SystemExit(f"the venvs run different torch versions ({versions}); one torchvision cannot serve both")
    torchvision_dir = install_torchvision(next(iter(versions.values())))

    work = args.keep or Path(tempfile.mkdtemp(prefix="ds-pipeline-example-"))
    work.mkdir(parents=True, exist_ok=True)
    shim = work / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SHIM.replace("{count}", str(args.samples))
                                           .replace("{size}", str(args.image_size)))
    extract_example(args.git_dir, work)
    config = write_config(work, args.own_config, args.set)

    names = [args.only] if args.only else ["shardwise", "deepspeed"]
    results: dict[str, dict[int, float]] = {}
    try:
        for name in names:
            losses, output, seconds = run_one(name, work, shim, torchvision_dir, config, args.steps, 2, args.timeout)
            if not losses:
                raise SystemExit(f"[{name}] printed no loss line (steps_per_print {'10' if args.own_config else '1'}, "
                                 f"{args.steps} steps); the end of its output:\n{output[-4000:]}")
            print(f"[{name}] {seconds:.1f} s, losses {[losses[s] for s in sorted(losses)]}", flush=True)
            results[name] = losses
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if len(results) < 2:
        return 0
    worst = compare(results)
    print(f"max relative difference {worst:.2e} (tolerance {args.tolerance:g})")
    if args.own_config:
        print("(steps_per_print 10: DeepSpeed printed the loss of the step it printed at, shardwise the mean over the "
              "ten steps before it, so these are different quantities; run without --own-config to compare)")
        return 0
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
