"""Every training Serve config in serve_configs/ (recursively: the CPU configs and the GPU recipes) validates and
builds its env and memory, without Ray: a broken config fails here, not on a GPU machine an hour into a run."""

from __future__ import annotations

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

import envs
import memory
from actors.config import load_train_config
from tests.conftest import REPO

TRAIN_IMPORT_PATH = "app.train:build_train_app"
AGENT_ENVS = ("alfworld", "webshop", "search", "math_tool")
CONFIGS = sorted((REPO / "serve_configs").rglob("*.yaml"))


def _train_apps(path):
    spec = yaml.safe_load(path.read_text())
    return [a for a in spec.get("applications", []) if a.get("import_path") == TRAIN_IMPORT_PATH]


def _id(path) -> str:
    return str(path.relative_to(REPO / "serve_configs"))


TRAIN_CONFIGS = [p for p in CONFIGS if _train_apps(p)]


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_serve_schema(path):
    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=_id)
def test_train_config_validates_and_builds(path):
    for app in _train_apps(path):
        cfg = load_train_config(app.get("args"))
        env = envs.make(cfg.env.name, **cfg.env_kwargs)
        memory.make(cfg.memory.name, **cfg.memory.kwargs)
        if cfg.max_steps or "max_steps" in cfg.env.kwargs:
            assert env.max_steps == (cfg.max_steps or cfg.env.kwargs["max_steps"])
        deployments = {d["name"]: d for d in app.get("deployments", [])}
        assert set(deployments) <= {"Policy", "TrainingRun", "Retriever"}, \
            f"unknown deployment in {path.name}: {set(deployments)}"
        assert ("Retriever" in deployments) == (cfg.retriever is not None), path.name
        policy_gpus = deployments.get("Policy", {}).get("ray_actor_options", {}).get("num_gpus", 0)
        if cfg.trainer.use_gpu:  # a GPU recipe: the policy replicas take GPUs too, and sample with async vLLM
            assert policy_gpus > 0 and cfg.policy.engine == "vllm-async", path.name
        else:
            assert not policy_gpus, f"{path.name}: Policy asks for GPUs but trainer.use_gpu is false"


@pytest.mark.parametrize("env", AGENT_ENVS)
def test_every_agent_env_has_a_cpu_config_and_a_gpu_recipe(env):
    assert env in envs.list_envs()
    for path, gpu in ((REPO / "serve_configs" / f"{env}_cpu.yaml", False),
                      (REPO / "serve_configs" / "gpu" / f"{env}.yaml", True)):
        (app,) = _train_apps(path)
        cfg = load_train_config(app["args"])
        assert cfg.env.name == env and cfg.trainer.use_gpu == gpu, path


def test_gpu_recipe_without_a_gpu_fails_before_any_actor_starts(monkeypatch):
    import ray

    from app.train import build_train_app

    (app,) = _train_apps(REPO / "serve_configs" / "gpu" / "sokoban.yaml")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(ValueError, match="trainer.use_gpu is true but this Ray cluster has no GPU"):
        build_train_app(app["args"])


@pytest.mark.parametrize("placement, words", [
    ({"trainer": {"gpu_node": 1}}, ["args.placement.trainer: no node of this Ray cluster has",
                                    "'gpu_node': 1.0", "check_nodes: false"]),
    ({"env_actors": {"env_node": 2}}, ["args.placement.env_actors: no node", "'env_node': 2.0"]),
    ({"trainer_strategy": "STRICT_SPREAD"}, ["args.placement.trainer_strategy: STRICT_SPREAD needs 2 nodes",
                                             "has 1"]),
])
def test_a_placement_no_node_can_satisfy_fails_before_any_actor_starts(ray_cluster, placement, words):
    from app.train import CONTROLLER_NAMESPACE, build_train_app, controller_name

    args = {"run_name": "placement-check", "policy": {"model": "default:tiny"}, "placement": placement}
    with pytest.raises(ValueError) as err:
        build_train_app(args)
    message = str(err.value)
    assert all(w in message for w in words), message
    with pytest.raises(ValueError):  # no controller (nor anything it starts) came up
        ray_cluster.get_actor(controller_name("placement-check"), namespace=CONTROLLER_NAMESPACE)
    # the same placement on a cluster whose nodes start on demand is not checked
    build_train_app({**args, "placement": {**placement, "check_nodes": False}})


@pytest.mark.parametrize("placement, words", [
    ({"trainer": {"CPU": 1}}, ["args.placement.trainer", "trainer.cpus_per_worker"]),
    ({"controller": {"head": 0}}, ["args.placement.controller", "must be > 0"]),
    ({"trainer_strategy": "TIGHT"}, ["args.placement.trainer_strategy", "'PACK'", "'STRICT_SPREAD'"]),
])
def test_a_bad_placement_names_the_field(placement, words):
    with pytest.raises(ValueError) as err:
        load_train_config({"placement": placement})
    message = str(err.value)
    assert all(w in message for w in words), message


def test_a_lora_target_the_model_lacks_fails_before_any_actor_starts():
    from app.train import build_train_app

    args = {"policy": {"model": "default:tiny", "lora": {"target_modules": ["q_proj", "attn_proj"]}}}
    with pytest.raises(ValueError) as err:
        build_train_app(args)
    message = str(err.value)
    assert "args.policy.lora.target_modules ['attn_proj']" in message and "'q_proj'" in message, message


@pytest.mark.parametrize("args, words", [
    ({"optim": {"lr": -1}}, ["args.optim.lr", "greater than 0"]),
    ({"algorithm": {"estimator": "ppo2"}}, ["args.algorithm.estimator", "allowed"]),
    ({"rollout": {"temperatur": 0.5}}, ["args.rollout.temperatur", "unknown field"]),
    ({"optim": {"old_logprobs": "rollout"}, "rollout": {"temperature": 0.7}},
     ["optim.old_logprobs", "rollout.temperature 1.0", "recompute"]),
    ({"optim": {"rollout_correction": "tis", "old_logprobs": "rollout"}}, ["args.optim", "old_logprobs: recompute"]),
    ({"trainer": {"mixed_precision": "fp8"}}, ["args.trainer.mixed_precision", "'fp32' or 'bf16'"]),
    ({"optim": {"lr_schedule": "step"}}, ["args.optim.lr_schedule", "'cosine'"]),
    ({"validation": {"split": "valid_unseen"}}, ["validation.split 'valid_unseen'", "allowed: ['val']"]),
    ({"env": {"name": "search", "kwargs": {"retriever": "serve"}}}, ["retriever 'serve'", "`retriever:` section"]),
    ({"algorithm": {"estimator": "hgpo", "params": {"history": 2}}}, ["args.algorithm", "do not fit estimator"]),
    ({"policy": {"dtype": "fp8"}}, ["args.policy.dtype", "'float32', 'bfloat16' or 'float16'"]),
    ({"weight_sync": {"bucket_mb": 10**7}}, ["args.weight_sync.bucket_mb", "does not fit", "eighth of this machine"]),
    ({"weight_sync": {"bucket_mb": 0}}, ["args.weight_sync.bucket_mb", "greater than or equal to 1"]),
    ({"weight_sync": {"backend": "nccl"}}, ["weight_sync.backend 'nccl'", "trainer.use_gpu true", "'object_store'"]),
    ({"weight_sync": {"backend": "mpi"}}, ["args.weight_sync.backend", "'object_store', 'gloo' or 'nccl'"]),
    ({"weight_sync": {"backend": "gloo", "timeout_s": 1}}, ["args.weight_sync.timeout_s", "greater than or equal to 5"]),
    ({"policy": {"lora": {"rank": 0}}}, ["args.policy.lora.rank", "greater than or equal to 1"]),
    ({"policy": {"lora": {"target_modules": []}}}, ["args.policy.lora.target_modules", "at least 1"]),
    ({"policy": {"lora": {"dropout": 1.0}}}, ["args.policy.lora.dropout", "less than 1"]),
    ({"policy": {"adapter": "runs/x/checkpoints/iter_000001/adapter"}}, ["policy.adapter is for serving",
                                                                          "policy.lora"]),
])
def test_bad_train_config_names_the_field_and_what_is_allowed(args, words):
    with pytest.raises(ValueError) as err:
        load_train_config(args)
    for word in words:
        assert word in str(err.value)
