"""The deployment files in deploy/ (KubeRay, Anyscale, the image) against what they wrap: KubeRay's own CRD schemas
(strictly: a field the CRD does not define is an error, as `kubectl apply --validate=strict` makes it), the Serve
configs they embed equal to serve_configs/agent.yaml outside the fields a cluster must change, and entrypoints that
name a training config that exists and validates. No Kubernetes cluster is reachable here: these check the files
on paper (README, Scaling out)."""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from actors.config import load_train_config
from app.agent import AgentConfig
from app.launch import train
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
CRDS = Path(os.environ.get("RAYGENT_KUBERAY_CRDS", REPO.parent / "shared" / "kuberay" / "crds"))
# What a cluster changes in serve_configs/agent.yaml, and nothing else: where Serve listens (every pod, not
# loopback), which checkpoint it serves and on what engine, and the replicas' sizes (a path and all below it).
CLUSTER_FIELDS = {("http_options", "host"), ("applications", 0, "args", "policy", "model"),
                  ("applications", 0, "args", "policy", "engine"), ("applications", 0, "args", "policy", "dtype"),
                  ("applications", 0, "deployments", 0, "num_replicas"),
                  ("applications", 0, "deployments", 0, "ray_actor_options")}


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: every object that lists its properties and neither allows
    extra ones nor preserves unknown fields gets additionalProperties false."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_validator(kind: str):
    import jsonschema

    path = CRDS / f"ray.io_{kind.lower()}s.yaml"
    if not path.is_file():
        pytest.skip(f"KubeRay's CRDs are not at {CRDS} (set RAYGENT_KUBERAY_CRDS to the folder holding {path.name})")
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft202012Validator(_strict(version["schema"]["openAPIV3Schema"]))


def _errors(kind: str, manifest: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in _crd_validator(kind).iter_errors(manifest)]


def _manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / name).read_text())


def _differences(a: Any, b: Any, path: tuple = ()) -> set[tuple]:
    """The paths at which two parsed YAML documents differ (a path as deep as both go)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {d for k in a.keys() | b.keys() for d in _differences(a.get(k), b.get(k), (*path, k))}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return {d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, (*path, i))}
    return set() if a == b else {path}


def _embedded_serve_configs() -> dict[str, dict[str, Any]]:
    service = _manifest("kuberay/rayservice-agent.yaml")
    anyscale = _manifest("anyscale/service.yaml")
    agent = yaml.safe_load((REPO / "serve_configs" / "agent.yaml").read_text())
    return {"kuberay/rayservice-agent.yaml": yaml.safe_load(service["spec"]["serveConfigV2"]),
            # an Anyscale service lists the applications; Anyscale owns the HTTP options and the proxy
            "anyscale/service.yaml": {**{k: v for k, v in agent.items() if k != "applications"},
                                      "applications": anyscale["applications"],
                                      "http_options": {**agent["http_options"], "host": "0.0.0.0"}}}


@pytest.mark.parametrize("name, kind", [("kuberay/rayjob-train.yaml", "RayJob"),
                                        ("kuberay/rayservice-agent.yaml", "RayService")])
def test_kuberay_manifests_validate_against_the_crds(name, kind):
    manifest = _manifest(name)
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == kind
    assert _errors(kind, manifest) == []


def test_the_strict_check_refuses_a_misspelt_field():
    """The check can fail: a field KubeRay does not know (a typo in a pod template) and a wrong type are errors."""
    manifest = _manifest("kuberay/rayjob-train.yaml")
    broken = copy.deepcopy(manifest)
    broken["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    broken["spec"]["shutdownAfterJobFinishes"] = "yes"
    errors = _errors("RayJob", broken)
    assert any("volumeMount" in e for e in errors), errors
    assert any(e.startswith("spec.shutdownAfterJobFinishes") for e in errors), errors


def test_ray_version_and_image_match_the_project():
    pinned = re.search(r'"ray\[[^\]]*\]==([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    for name in ("kuberay/rayjob-train.yaml", "kuberay/rayservice-agent.yaml"):
        spec = _manifest(name)["spec"]
        cluster = spec.get("rayClusterSpec") or spec["rayClusterConfig"]
        assert cluster["rayVersion"] == pinned, name
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    # the image installs the project the one way (make install) with the engine extra named: no nvidia-smi at build
    assert re.search(r"^RUN make install .*EXTRA=\$EXTRA", dockerfile, re.M) and "ARG EXTRA=gpu" in dockerfile


@pytest.mark.parametrize("name", sorted(_embedded_serve_configs()))
def test_embedded_serve_configs_are_agent_yaml_with_cluster_fields_only(name):
    embedded = _embedded_serve_configs()[name]
    ServeDeploySchema.model_validate(embedded)
    AgentConfig.model_validate(embedded["applications"][0]["args"])
    agent = yaml.safe_load((REPO / "serve_configs" / "agent.yaml").read_text())
    drifted = {d for d in _differences(agent, embedded) if not any(d[:len(f)] == f for f in CLUSTER_FIELDS)}
    assert not drifted, f"{name} drifted from serve_configs/agent.yaml at {drifted}"
    assert embedded["http_options"]["host"] == "0.0.0.0"


def _entrypoint_config(command: str) -> str:
    words = shlex.split(command.split("&&")[-1])
    assert words[:2] == ["raygent", "train"], command
    return words[2]


@pytest.mark.parametrize("name", ["kuberay/rayjob-train.yaml", "anyscale/job.yaml"])
def test_training_entrypoints_name_a_config_that_validates(name):
    manifest = _manifest(name)
    config = REPO / _entrypoint_config(manifest.get("entrypoint") or manifest["spec"]["entrypoint"])
    assert config.is_file(), f"{name} names {config}, which does not exist"
    spec = yaml.safe_load(config.read_text())
    (app,) = spec["applications"]
    cfg = load_train_config(app["args"])
    assert cfg.trainer.use_gpu and cfg.output_dir == "runs"  # the folder the manifests mount


def test_an_entrypoint_naming_a_missing_config_exits_with_2_before_anything_starts(tmp_path):
    said = []
    assert train(tmp_path / "no_such_recipe.yaml", out=said.append) == 2
    assert "no_such_recipe.yaml" in said[0], said
