"""The deployment files in deploy/ (KubeRay, Anyscale, the image) against what they wrap: KubeRay's own CRD schemas
(strictly: a field the CRD does not define is an error, as `kubectl apply --validate=strict` makes it), the Serve
configs they embed equal to serve_configs/agent.yaml outside the fields a cluster must change, and entrypoints that
name a training config that exists and validates. No Kubernetes cluster is reachable here: these check the files
on paper (README, Scaling out)."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from actors.config import load_train_config
from actors.storage import is_uri
from app.agent import AgentConfig
from app.cli import build_parser
from app.launch import parse_overrides, train
from app.sft import read_config_file, set_dotted
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


RAYJOBS = ("kuberay/rayjob-train.yaml", "kuberay/rayjob-train-multinode.yaml")


@pytest.mark.parametrize("name, kind", [*((n, "RayJob") for n in RAYJOBS),
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
    for name in (*RAYJOBS, "kuberay/rayservice-agent.yaml"):
        spec = _manifest(name)["spec"]
        cluster = spec.get("rayClusterSpec") or spec["rayClusterConfig"]
        assert cluster["rayVersion"] == pinned, name
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    # the image installs the project the one way (make install) with the engine extra named: no nvidia-smi at build
    assert re.search(r"^RUN make install .*EXTRA=\$EXTRA", dockerfile, re.M) and "ARG EXTRA=gpu" in dockerfile


@pytest.mark.parametrize("name", sorted(_embedded_serve_configs()))
def test_embedded_serve_configs_are_agent_yaml_with_cluster_fields_only(name, tmp_path):
    embedded = _embedded_serve_configs()[name]
    ServeDeploySchema.model_validate(embedded)
    args = copy.deepcopy(embedded["applications"][0]["args"])
    if is_uri(args["policy"]["model"]):
        # the bucket is the cluster's (validation would reach it before any actor starts): the rest of the
        # config is checked here with a local folder in its place
        (tmp_path / "config.json").write_text("{}")
        args["policy"]["model"] = tmp_path.as_uri()
    AgentConfig.model_validate(args)
    agent = yaml.safe_load((REPO / "serve_configs" / "agent.yaml").read_text())
    drifted = {d for d in _differences(agent, embedded) if not any(d[:len(f)] == f for f in CLUSTER_FIELDS)}
    assert not drifted, f"{name} drifted from serve_configs/agent.yaml at {drifted}"
    assert embedded["http_options"]["host"] == "0.0.0.0"


def test_the_agent_service_serves_from_the_storage_the_jobs_write_to():
    """The RayService reads the checkpoint through storage (an S3 URI under the jobs' checkpoint.storage, with the
    jobs' credentials), not from a volume: its pods, like the multi-node job's, share no disk."""
    service = _manifest("kuberay/rayservice-agent.yaml")
    model = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["policy"]["model"]
    cluster = service["spec"]["rayClusterConfig"]
    for name in RAYJOBS:
        _, args = _entrypoint_args(_manifest(name))
        storage = load_train_config(args).checkpoint.storage
        assert storage and model.startswith(f"{storage}/{args['run_name']}/checkpoints/"), (name, storage, model)
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        assert not [v for v in spec.get("volumes", []) if "emptyDir" not in v], group
        (container,) = spec["containers"]
        assert {"secretRef": {"name": "raygent-s3"}} in container.get("envFrom", []), group


def _entrypoint(command: str, env: dict[str, str] | None = None) -> tuple[Path, dict[str, Any]]:
    """The training config a `raygent train CONFIG [--set K=V ...]` entrypoint names, and its overrides (with the
    head pod's environment variables expanded, as the shell that runs the entrypoint expands them)."""
    words = shlex.split(command.split("&&")[-1])
    assert words[:2] == ["raygent", "train"], command
    words = [re.sub(r"\$(\w+)", lambda m: (env or {})[m.group(1)], w) for w in words]
    parsed = build_parser().parse_args(words[1:])
    return REPO / parsed.config, parse_overrides(parsed.set)


def _entrypoint_args(manifest: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The training app's args that a job's entrypoint runs: its config with its `--set` overrides applied."""
    head_env = {}
    if "spec" in manifest:
        (head,) = manifest["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
        head_env = {e["name"]: e["value"] for e in head.get("env", [])}
    config, overrides = _entrypoint(manifest.get("entrypoint") or manifest["spec"]["entrypoint"], head_env)
    assert config.is_file(), f"the entrypoint names {config}, which does not exist"
    args = read_config_file(config)
    for key, value in overrides.items():
        set_dotted(args, key, value)
    return config, args


@pytest.mark.parametrize("name", [*RAYJOBS, "anyscale/job.yaml"])
def test_training_entrypoints_name_a_config_that_validates(name):
    _, args = _entrypoint_args(_manifest(name))
    cfg = load_train_config(args)
    assert cfg.trainer.use_gpu and cfg.output_dir == "runs"  # the folder the manifests mount


def _groups(manifest: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each group's Ray resources as its pods start Ray: custom resources from rayStartParams, GPUs per pod
    (rayStartParams num-gpus, else the container's nvidia.com/gpu limit) times the group's replicas."""
    cluster = manifest["spec"]["rayClusterSpec"]
    groups = {"head": {**cluster["headGroupSpec"], "replicas": 1}}
    groups.update({g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])})
    out = {}
    for name, group in groups.items():
        params = group.get("rayStartParams") or {}
        custom = json.loads(json.loads(params["resources"])) if "resources" in params else {}
        (container,) = group["template"]["spec"]["containers"]
        gpus = float(params.get("num-gpus", container["resources"]["limits"].get("nvidia.com/gpu", 0)))
        out[name] = {**custom, "GPU": gpus, "replicas": group["replicas"]}
    return out


def _placement_errors(manifest: dict[str, Any]) -> list[str]:
    """What the multi-node job asks that its groups cannot give: a placement set no group offers, more GPUs than
    the GPU groups hold, or a pod that mounts a volume (the pods share no disk: storage is a URI)."""
    config, args = _entrypoint_args(manifest)
    cfg = load_train_config(args)
    groups = _groups(manifest)
    errors = [f"placement.{role}: no group offers {wanted}" for role in ("controller", "env_actors", "trainer")
              if (wanted := getattr(cfg.placement, role))
              and not any(all(g.get(k, 0) >= v for k, v in wanted.items()) for g in groups.values())]
    (app,) = yaml.safe_load(config.read_text())["applications"]
    policy = next(d for d in app["deployments"] if d["name"] == "Policy")
    wanted_gpus = policy["num_replicas"] * policy["ray_actor_options"].get("num_gpus", 0) \
        + (cfg.trainer.num_workers if cfg.trainer.use_gpu else 0)
    have_gpus = sum(g["GPU"] * g["replicas"] for g in groups.values())
    if wanted_gpus > have_gpus:
        errors.append(f"{wanted_gpus} GPUs wanted (Policy replicas + Train workers), the groups have {have_gpus}")
    if not cfg.checkpoint.storage or "://" not in cfg.checkpoint.storage:
        errors.append(f"checkpoint.storage {cfg.checkpoint.storage!r} is not a URI")
    cluster = manifest["spec"]["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        errors += [f"{group.get('groupName', 'head')} mounts volume {v['name']}" for v in
                   group["template"]["spec"].get("volumes", []) if "emptyDir" not in v]
    return errors


def test_the_multinode_job_spreads_the_run_over_groups_that_share_no_disk():
    """Head, a CPU group and a GPU group: the controller on the head, the env-group actors on the CPU pods, the
    Policy replicas and Train workers on the GPU pods (the only ones with GPUs), storage an S3 URI and no shared
    volume. The check can fail: a placement naming a resource no group starts with, a GPU group too small, or a
    shared volume mounted are each reported."""
    manifest = _manifest("kuberay/rayjob-train-multinode.yaml")
    assert _placement_errors(manifest) == []
    groups = _groups(manifest)
    assert set(groups) == {"head", "cpu", "gpu"} and groups["head"]["GPU"] == groups["cpu"]["GPU"] == 0
    _, args = _entrypoint_args(manifest)
    placement = load_train_config(args).placement
    assert placement.controller == {"head_node": 1} and placement.env_actors == {"cpu_node": 1}

    broken = copy.deepcopy(manifest)
    broken["spec"]["entrypoint"] = broken["spec"]["entrypoint"].replace("cpu_node", "env_node")
    gpu = broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]
    gpu["replicas"] = 1
    gpu["template"]["spec"]["volumes"].append({"name": "runs", "persistentVolumeClaim": {"claimName": "raygent-runs"}})
    errors = _placement_errors(broken)
    assert any(e.startswith("placement.env_actors") for e in errors), errors
    assert any("GPUs wanted" in e for e in errors) and any("mounts volume runs" in e for e in errors), errors


def test_an_entrypoint_naming_a_missing_config_exits_with_2_before_anything_starts(tmp_path):
    said = []
    assert train(tmp_path / "no_such_recipe.yaml", out=said.append) == 2
    assert "no_such_recipe.yaml" in said[0], said
