"""cluster/kuberay/: the RayCluster and the RayJob checked against KubeRay's CRD schemas (tests/kuberay_schemas/,
unknown fields refused as `kubectl apply --validate=strict` would), one cluster spec for both, the versions, storage,
secrets and token auth they promise, and `grpo-dist check` on the config the RayJob runs."""

from __future__ import annotations

import copy
import gzip
import json
import re
import shlex
import tomllib

import jsonschema
import pytest
import yaml
from conftest import REPO, TESTS_DIR, cli_here

KUBERAY = REPO / "cluster" / "kuberay"
IMAGE_ROOT = "/opt/grpo-dist"  # where docker/Dockerfile puts the repository's configs


def manifest(name: str) -> dict:
    return yaml.safe_load((KUBERAY / name).read_text())


def strict(schema):
    """A CRD's structural schema as JSON Schema: objects with declared properties refuse others (unless the CRD
    keeps unknown fields), and int-or-string fields take either."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    keeps_unknown = out.pop("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


def validator(kind: str) -> jsonschema.Draft7Validator:
    with gzip.open(TESTS_DIR / "kuberay_schemas" / f"{kind.lower()}.v1.json.gz", "rt") as file:
        crd = json.load(file)
    assert crd["kind"] == kind
    return jsonschema.Draft7Validator(strict(crd["schema"]))


def errors(kind: str, document: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(kind).iter_errors(document)]


@pytest.mark.parametrize(("name", "kind"), [("raycluster.yaml", "RayCluster"), ("rayjob.yaml", "RayJob")])
def test_a_manifest_is_valid_against_kuberays_crd_schema(name, kind):
    document = manifest(name)
    assert document["apiVersion"] == "ray.io/v1" and document["kind"] == kind
    assert errors(kind, document) == []


def test_the_schema_check_refuses_a_misspelt_field_and_a_wrong_type():
    cluster = manifest("raycluster.yaml")
    misspelt = copy.deepcopy(cluster)
    misspelt["spec"]["workerGroupSpecs"][1]["maxReplica"] = misspelt["spec"]["workerGroupSpecs"][1].pop("maxReplicas")
    assert any("maxReplica" in line for line in errors("RayCluster", misspelt))
    wrong = copy.deepcopy(cluster)
    wrong["spec"]["authOptions"]["mode"] = "password"
    assert any(line.startswith("spec.authOptions.mode") for line in errors("RayCluster", wrong))
    job = manifest("rayjob.yaml")
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = "8"
    assert errors("RayJob", job)


def test_the_rayjob_runs_the_rayclusters_cluster_and_cleans_up_after_itself():
    job = manifest("rayjob.yaml")["spec"]
    assert job["rayClusterSpec"] == manifest("raycluster.yaml")["spec"]
    assert job["shutdownAfterJobFinishes"] is True and job["ttlSecondsAfterFinished"] > 0
    assert job["backoffLimit"] >= 1  # a lost cluster is retried on a new one, which resumes (--resume auto)
    assert shlex.split(job["entrypoint"])[-2:] == ["--resume", "auto"]


def test_the_cluster_pins_rays_version_takes_a_token_and_mounts_shared_storage_and_secrets():
    spec = manifest("raycluster.yaml")["spec"]
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (ray_pin,) = [re.search(r"==(\S+)$", dep).group(1) for dep in dependencies if dep.startswith("ray[")]
    assert spec["rayVersion"] == ray_pin
    assert spec["authOptions"]["mode"] == "token" and spec["authOptions"]["secretName"]
    claim = manifest("storage.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    groups = {"head": spec["headGroupSpec"], **{group["groupName"]: group for group in spec["workerGroupSpecs"]}}
    assert set(groups) == {"head", "learner", "generators"}
    learner, generators = groups["learner"], groups["generators"]
    assert learner["minReplicas"] == learner["maxReplicas"]  # the autoscaler grows generators only
    assert generators["maxReplicas"] > generators["minReplicas"] and spec["enableInTreeAutoscaling"]
    for name, group in groups.items():
        pod = group["template"]["spec"]
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        (container,) = pod["containers"]
        mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
        assert volumes[mounts["/runs"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"], name
        secrets = [source["secretRef"]["name"] for source in container.get("envFrom", [])]
        assert secrets == ["grpo-dist-secrets"], name
        assert container["image"].endswith("grpo-dist:gpu"), name


def entrypoint() -> tuple[str, list[str]]:
    """The config the RayJob trains (as a path in this repository) and its overrides."""
    words = shlex.split(manifest("rayjob.yaml")["spec"]["entrypoint"])
    assert words[:2] == ["grpo-dist", "train"], words
    config, overrides = words[2], [word for word in words[3:] if word not in ("--resume", "auto")]
    assert config.startswith(IMAGE_ROOT + "/"), config
    return str(REPO / config.removeprefix(IMAGE_ROOT + "/")), overrides


def test_the_rayjob_writes_its_run_to_the_shared_claim():
    _, overrides = entrypoint()
    settings = dict(override.split("=", 1) for override in overrides)
    assert settings["run.output_dir"].startswith("/runs") and settings["model.path"].startswith("/runs")
    assert settings["ray.address"] == "auto"


@pytest.mark.slow
def test_grpo_dist_check_passes_the_config_the_rayjob_runs(capfd):
    config, overrides = entrypoint()
    done = cli_here(capfd, "check", config, *overrides, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_pod_lets_bubblewrap_make_the_namespaces_isolation_requires():
    """The image runs as a non-root user, so bubblewrap needs user namespaces, which the container runtime's default
    seccomp and AppArmor profiles refuse: every pod template of both manifests lifts them (README: Sandbox)."""
    cluster = manifest("raycluster.yaml")["spec"]
    job = manifest("rayjob.yaml")["spec"]["rayClusterSpec"]
    for spec in (cluster, job):
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            context = group["template"]["spec"]["securityContext"]
            assert context["seccompProfile"] == {"type": "Unconfined"}, group.get("groupName", "head")
            assert context["appArmorProfile"] == {"type": "Unconfined"}, group.get("groupName", "head")
