"""``shardwise k8s``: the PyTorchJob manifest validates against the CRD's schema (tests/data), and a simulation
that runs every pod's command as a local process, with the variables the training operator injects, trains
to the oracle's losses."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardwise.distributed.env import free_port
from shardwise.launcher import k8s
from tests.distributed.test_multinode import TRAIN, child_env
from tests.rank_zygote import PRELOAD, routing

pytestmark = [pytest.mark.timeout(180)]

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "data" / "pytorchjob_crd_schema.json").read_text())
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """The OpenAPI v3 subset CRDs use; unknown fields are errors (kubectl's strict field validation)."""
    if schema.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, (int, str)) and not isinstance(value, bool) else [f"{path}: not int-or-string"]
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok and (schema.get("format") != "int32" or -2**31 <= value < 2**31) else [f"{path}: not {schema.get('format', 'integer')}"]
    if kind in TYPES and not isinstance(value, TYPES[kind]):
        return [f"{path}: expected {kind}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: {value!r} not in {schema['enum']}"]
    errors = _limits(value, schema, path)
    if kind == "array":
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    if kind == "object" and not schema.get("x-kubernetes-preserve-unknown-fields"):
        errors += [f"{path}: missing required {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key, schema.get("additionalProperties"))
            errors += [f"{path}.{key}: unknown field"] if sub is None else validate(item, sub, f"{path}.{key}")
    return errors


def _limits(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Lengths, patterns, minimums, item counts, and unique keys in a list the API server treats as a map."""
    problems = []
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            problems.append(f"{path}: length {len(value)} outside [{schema.get('minLength', 0)}, {schema.get('maxLength')}]")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            problems.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, int) and "minimum" in schema and value < schema["minimum"]:
        problems.append(f"{path}: {value} < minimum {schema['minimum']}")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            problems.append(f"{path}: more than {schema['maxItems']} items")
        if schema.get("x-kubernetes-list-type") == "map":
            keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"]) for item in value]
            problems += [f"{path}: duplicate key {key}" for key in set(keys) if keys.count(key) > 1]
    return problems


def manifest(*extra: str) -> dict[str, Any]:
    args = k8s.build_parser().parse_args(["--name", "tiny", "--image", "reg.example/shardwise:1", *extra,
                                          "--", "train.py", "--label", "a b"])
    return k8s.build_manifest(args)


def test_validator_catches_what_the_api_server_would() -> None:
    bad = manifest()
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] = "Sometimes"
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["gpu"] = 1
    del bad["spec"]["runPolicy"]
    assert validate(bad, SCHEMA) == [
        "$.spec: missing required 'runPolicy'",
        "$.spec.pytorchReplicaSpecs.Master.restartPolicy: 'Sometimes' not in ['Always', 'OnFailure', 'Never', 'ExitCode']",
        "$.spec.pytorchReplicaSpecs.Master.template.spec.containers[0].gpu: unknown field",
    ]


@pytest.mark.parametrize("extra", [(), ("--workers", "4", "--gpus-per-worker", "8", "--pvc", "data:/mnt/data",
                                        "--pvc", "ckpt:/ckpt", "--tensorboard-logdir", "/mnt/data/tb", "--env", "A=1",
                                        "--namespace", "ml")])
def test_manifest_validates_against_the_crd_schema(extra: tuple[str, ...]) -> None:
    job = manifest(*extra)
    assert validate(job, SCHEMA) == []
    replicas = job["spec"]["pytorchReplicaSpecs"]
    container = replicas["Master"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"  # the operator finds the training container by this name
    if extra:
        assert replicas["Worker"]["replicas"] == 3 and job["spec"]["nprocPerNode"] == "8"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
        assert container["command"][:2] == ["sh", "-c"] and "exec shardwise train.py --label 'a b'" in container["command"][2]
        assert {"name": "pvc-1", "mountPath": "/ckpt"} in container["volumeMounts"]
    else:
        assert "Worker" not in replicas and container["command"] == ["shardwise", "train.py", "--label", "a b"]


def test_yaml_output_reads_back_as_the_manifest() -> None:
    import yaml  # PyYAML: a test extra

    job = manifest("--workers", "2", "--pvc", "data:/mnt", "--tensorboard-logdir", "/mnt/tb")
    assert yaml.safe_load(k8s.to_yaml(job)) == job


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--name", "Bad_Name", "--image", "i", "--", "t.py"], "--name 'Bad_Name': must be a lower-case DNS label"),
     (["--name", "ok", "--image", "i"], "no script given; put it after '--'"),
     (["--name", "ok", "--image", "i", "--pvc", "data", "--", "t.py"], "--pvc 'data': expected NAME:/mount/path"),
     (["--name", "ok", "--image", "i", "--workers", "0", "--", "t.py"], "--workers must be at least 1")],
)
def test_bad_k8s_options_are_explained(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert k8s.main(args) == 2
    assert message in capsys.readouterr().err


def operator_env(job: dict[str, Any], replica: str, index: int, port: int) -> dict[str, str]:
    """What the training operator injects into pod ``<name>-<replica>-<index>`` (MASTER_ADDR stands for the
    master's service, ``<name>-master-0``, which is this machine here)."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    nodes = sum(spec["replicas"] for spec in specs.values())
    nproc = int(job["spec"]["nprocPerNode"])
    rank = index + (1 if replica == "Worker" else 0)
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nodes * nproc), "RANK": str(rank),
            "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(rank), "PET_NNODES": str(nodes),
            "PYTHONUNBUFFERED": "1"}


def run_pods(job: dict[str, Any], cwd: Path, timeout: float = 150, preload: tuple[str, ...] = PRELOAD) -> None:
    """Every pod's command as a local process with the operator's env (its ranks forked from a zygote that
    imported ``preload``, tests/rank_zygote.py); all must succeed."""
    port, shardwise_bin = free_port(), str(Path(sys.executable).parent / "shardwise")
    pods = []
    for replica, spec in job["spec"]["pytorchReplicaSpecs"].items():
        container = spec["template"]["spec"]["containers"][0]
        command = [shardwise_bin if word == "shardwise" else word for word in container["command"]]
        env = {**child_env(), **routing(preload), **{e["name"]: e["value"] for e in container["env"]}}
        for index in range(spec["replicas"]):
            pods.append(subprocess.Popen(command, cwd=cwd, env={**env, **operator_env(job, replica, index, port)},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [pod.communicate(timeout=timeout)[0] for pod in pods]
    assert all(pod.returncode == 0 for pod in pods), "\n".join(o[-3000:] for o in outputs)


def test_simulated_pytorchjob_trains_to_the_oracle(tmp_path: Path) -> None:
    from tests.parity import oracle

    (tmp_path / "train.py").write_text(TRAIN)
    out = tmp_path / "losses.json"
    args = k8s.build_parser().parse_args(["--name", "tiny", "--image", "img", "--workers", "2", "--gpus-per-worker", "2",
                                          "--", "train.py", "--out", str(out)])
    job = k8s.build_manifest(args)
    assert validate(job, SCHEMA) == []
    run_pods(job, tmp_path)
    got = json.loads(out.read_text())
    assert got["world"] == 4
    assert got["losses"] == pytest.approx(oracle(4, 8)[0], rel=1e-5)
