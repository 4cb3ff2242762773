"""Write the TrainJob CRD's OpenAPI schema (Kubeflow Trainer v2), trimmed for the tests, to a JSON file.

    python tools/extract_trainjob_crd_schema.py trainer.kubeflow.org_trainjobs.yaml tests/data/trainjob_crd_schema.json

The input is the CRD as Kubeflow Trainer releases it (``manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml``
in github.com/kubeflow/trainer, Apache-2.0). Kept: the ``v1alpha1`` openAPIV3Schema's structure — types,
formats, enums, required lists, int-or-string and preserve-unknown-fields markers — without ``status`` (a
manifest never sets it), descriptions and CEL rules (``x-kubernetes-validations``, which need the API
server); the top-level ``metadata`` (the API server's own ObjectMeta) takes any field.
``tests/distributed/test_k8s_trainjob.py`` validates ``shardwise k8s --kind trainjob`` output with it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

DROPPED = {"description", "x-kubernetes-validations"}


def trimmed(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: trimmed(value) for key, value in node.items() if key not in DROPPED}
    if isinstance(node, list):
        return [trimmed(value) for value in node]
    return node


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path, help="trainer.kubeflow.org_trainjobs.yaml of a Kubeflow Trainer release")
    parser.add_argument("out", type=Path)
    parser.add_argument("--release", required=True, help="the Trainer release the CRD is from, e.g. v2.3.0")
    args = parser.parse_args()
    crd = next(doc for doc in yaml.safe_load_all(args.crd.read_text()) if doc and doc.get("kind") == "CustomResourceDefinition")
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = trimmed(version["schema"]["openAPIV3Schema"])
    schema["properties"].pop("status", None)
    # The API server checks a resource's own ObjectMeta itself; the CRD leaves it a bare object.
    schema["properties"]["metadata"]["x-kubernetes-preserve-unknown-fields"] = True
    comment = (f"The openAPIV3Schema of Kubeflow Trainer {args.release}'s TrainJob CRD ({crd['spec']['group']}/v1alpha1, "
               "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml, Apache-2.0), written by "
               "tools/extract_trainjob_crd_schema.py: without status, descriptions and CEL rules; metadata is "
               "ObjectMeta, which the API server checks itself.")
    args.out.write_text(json.dumps({"$comment": comment, **schema}, separators=(",", ":"), sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
