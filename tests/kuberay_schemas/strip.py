"""Write the validation schema of a KubeRay CustomResourceDefinition (ray-operator/config/crd/bases/ in the
KubeRay repository, Apache-2.0, release v1.7.0): its served version's openAPIV3Schema with every
`description` removed (the structure is what a manifest is checked against), as compact JSON.

    python strip.py ray.io_rayclusters.yaml | gzip -9n > tests/kuberay_schemas/raycluster.v1.json.gz
"""

from __future__ import annotations

import json
import sys

import yaml


def structure(node):
    if isinstance(node, dict):
        return {key: structure(value) for key, value in node.items() if key != "description"}
    if isinstance(node, list):
        return [structure(value) for value in node]
    return node


def main(path: str) -> None:
    crd = yaml.safe_load(open(path))
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema = structure(version["schema"]["openAPIV3Schema"])
    kind, api_version = crd["spec"]["names"]["kind"], f"{crd['spec']['group']}/{version['name']}"
    out = {"kind": kind, "apiVersion": api_version, "schema": schema}
    json.dump(out, sys.stdout, separators=(",", ":"), sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1])
