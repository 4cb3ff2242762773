"""The fine-tuning example script started every way the README shows: `shardwise --num_gpus 2`, `torchrun`,
a hostfile across two hosts (network namespaces, ssh), and the pods of a `shardwise k8s` PyTorchJob.

Each run is LoRA under ZeRO-3 at world size 2 from the same base model and seed, so each must write the same
adapter (the run under `shardwise` is itself checked against a single-process oracle in test_finetune_lora).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shardwise.distributed.env import free_port
from shardwise.launcher import k8s
from tests.distributed.test_finetune_lora import BUNDLED, model_dirs  # noqa: F401 - model_dirs is a fixture
from tests.distributed.test_k8s import run_pods
from tests.distributed.test_multinode import RUN_TIMEOUT_S, child_env, launcher_cmd, run_ok, ssh_args
from tests.distributed.test_multinode_hosts import Hosts, namespace_hosts
from tests.rank_zygote import HF_PRELOAD, routing

pytest.importorskip("peft")
safetensors = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.timeout(300)]

SCRIPT = BUNDLED / "train.py"
TRAINING = ["--steps", "3", "--eval_interval", "0", "--save_interval", "0", "--samples", "1", "--max_new_tokens", "4",
            "--max_seq_len", "48", "--lora_target_modules", "q_proj,v_proj", "--lr", "1e-2"]


def script_args(model_dir: Path, out: Path) -> list[str]:
    return ["--model", str(model_dir), "--output_dir", str(out), "--save_dir", str(out / "checkpoints"), *TRAINING]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return safetensors.load_file(out / "adapter" / "adapter_model.safetensors")


def assert_same_adapter(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def llama(model_dirs: dict[str, Path]) -> Path:  # noqa: F811 - the imported fixture
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def under_shardwise(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("shardwise")
    stdout = run_ok(launcher_cmd(["--num_gpus", "2", str(SCRIPT), *script_args(llama, out)]), out,
                    {**child_env(), **routing(HF_PRELOAD)}).stdout
    assert "lora fine-tuning" in stdout and (out / "adapter" / "adapter_config.json").exists(), stdout[-3000:]
    trained = adapter(out)
    assert any("lora_B" in name and value.abs().sum() > 0 for name, value in trained.items())  # B starts at zero
    return trained


def test_torchrun_writes_the_same_adapter(llama: Path, under_shardwise: dict, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(SCRIPT), *script_args(llama, tmp_path)]
    run_ok(cmd, tmp_path, child_env())
    assert_same_adapter(adapter(tmp_path), under_shardwise)


def test_kubernetes_pods_write_the_same_adapter(llama: Path, under_shardwise: dict, tmp_path: Path) -> None:
    args = k8s.build_parser().parse_args(["--name", "ft", "--image", "img", "--workers", "2", "--gpus-per-worker", "1",
                                          "--", str(SCRIPT), *script_args(llama, tmp_path)])
    run_pods(k8s.build_manifest(args), tmp_path, timeout=RUN_TIMEOUT_S, preload=HF_PRELOAD)
    assert_same_adapter(adapter(tmp_path), under_shardwise)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    with namespace_hosts(tmp_path_factory, "the hostfile run") as made:
        yield made


def test_hostfile_across_two_nodes_writes_the_same_adapter(llama: Path, under_shardwise: dict, hosts: Hosts,
                                                           tmp_path: Path) -> None:
    args, env = ssh_args(hosts, "ssh")
    cmd = launcher_cmd([*args, "--hostfile", str(hosts.hostfile(tmp_path / "hostfile", slots=1)), str(SCRIPT),
                        *script_args(llama, tmp_path)])
    run_ok(hosts.in_ns(0, cmd), tmp_path, env)
    assert_same_adapter(adapter(tmp_path), under_shardwise)
