"""The training application behind `serve run serve_configs/train.yaml`.

Two deployments: `Policy` (the replicas the rollouts sample from; sized in the Serve config) and `TrainingRun`, the
HTTP ingress that starts the controller actor and exposes it (a third, `Retriever`, when the config has a
`retriever:` section for a search env):
    GET  /status            iteration, phase, weight version, last metrics
    GET  /metrics/history   every logged record
    POST /checkpoint        a checkpoint at the end of the running iteration (returns its folder)
    POST /stop              graceful: finish the iteration, checkpoint, stop
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.checkpoint import (
    fetch_latest_checkpoint,
    in_storage,
    latest_checkpoint,
    latest_in_storage,
    load_state,
    mirror_checkpoint,
    publish_start_model,
)
from actors.config import TrainConfig, check_resume_config, load_train_config, run_storage
from actors.controller import Controller
from actors.lora import check_targets
from actors.storage import STORAGE_COMPLETE, Storage, is_uri
from actors.trainer import worker_resources
from app.default_model import resolve_model
from app.policy import Policy
from app.retriever import Retriever

logger = logging.getLogger("ray.serve")
CONTROLLER_NAMESPACE = "raygent"
STATUS_TIMEOUT_S = 2.0  # /status answers within this even while the controller is busy starting

train_api = FastAPI(title="raygent training run", version="0.1")


def controller_name(run_name: str) -> str:
    return f"raygent-controller-{run_name}"


def config_hash(config: dict[str, Any]) -> str:
    """Which application a controller belongs to: the hash of its training config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1, graceful_shutdown_wait_loop_s=0.5)
@serve.ingress(train_api)
class TrainingRun:
    """The run's HTTP routes, and the keeper of its controller: the controller is a named, detached actor whose
    lifetime is the application's. A restarted ingress replica finds it (same config hash) and goes on with it; a
    controller of an older application of the same name (another config) is replaced; a controller that died is
    started again by the health check and resumes from the latest checkpoint; a controller whose application is
    gone stops itself (checkpoint first) once the heartbeats of `check_health` stop coming."""

    def __init__(self, policy: DeploymentHandle, config: dict[str, Any], model_path: str, resume_from: str | None,
                 retriever: DeploymentHandle | None = None):
        self.cfg = TrainConfig.model_validate(config)
        self.config, self.policy, self.model_path, self.retriever = config, policy, model_path, retriever
        self.config_hash = config_hash(config)
        self.started = time.time()
        self.restarts = 0
        self.controller = self._attach(resume_from)

    def _attach(self, resume_from: str | None) -> Any:
        name = controller_name(self.cfg.run_name)
        try:
            existing = ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
            same = ray.get(existing.config_hash.remote(), timeout=30) == self.config_hash
            if same and not ray.get(existing.status.remote(), timeout=30)["done"]:
                return existing  # this application's run, still going (the ingress restarted)
            ray.kill(existing)  # an ended run, or the run of an older application of the same name
        except ValueError:  # none yet
            pass
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # dead or unreachable: a new one takes its name
        controller = Controller.options(name=name, namespace=CONTROLLER_NAMESPACE, lifetime="detached",
                                        get_if_exists=False, resources=self.cfg.placement.controller).remote(self.config, self.policy, self.model_path,
                                                                    resume_from, self.retriever,
                                                                    self.config_hash)
        controller.start.remote()
        return controller

    async def check_health(self) -> None:
        """Serve calls this every few seconds: a heartbeat to the controller, or a new controller if it died."""
        try:
            await asyncio.wait_for(self.controller.heartbeat.remote(), timeout=10)
        except asyncio.TimeoutError:
            pass  # busy (e.g. blocked in a long call): not dead
        except ray.exceptions.RayActorError:
            self.restarts += 1
            latest = self._latest() if self.cfg.checkpoint.resume != "never" else None
            logger.warning("the run's controller died; starting it again from %s", latest or "the start")
            self.controller = self._attach(str(latest) if latest else None)

    def _latest(self) -> Path | None:
        """The run's latest checkpoint: in storage when the run has it (this replica's node may not be the
        controller's; a controller on a node without it fetches it), else in the run folder."""
        storage = self.cfg.checkpoint.run_storage(self.cfg.run_name)
        name = latest_in_storage(storage) if storage is not None else None
        return self.cfg.run_dir / "checkpoints" / name if name else latest_checkpoint(self.cfg.run_dir)

    @train_api.get("/")
    @train_api.get("/status")
    async def status(self) -> dict[str, Any]:
        """The run's state; while the controller process is still coming up, that it is starting (at once)."""
        try:
            return await asyncio.wait_for(self.controller.status.remote(), timeout=STATUS_TIMEOUT_S)
        except asyncio.TimeoutError:
            return {"phase": "starting", "done": False, "detail": "the controller is starting",
                    "uptime_s": time.time() - self.started}
        except ray.exceptions.RayActorError:
            return {"phase": "recovering", "done": False, "detail": "the controller died; the health check starts "
                    "it again from the latest checkpoint", "controller_restarts": self.restarts}

    @train_api.get("/metrics/history")
    async def history(self, since: int = 0) -> list[dict[str, Any]]:
        """Every logged record (from index `since`: a follower asks only for what is new)."""
        try:
            records = await asyncio.wait_for(self.controller.history.remote(), timeout=STATUS_TIMEOUT_S)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError):
            return []
        return records[max(0, since):]

    @train_api.post("/checkpoint")
    async def checkpoint(self) -> dict[str, Any]:
        return await self.controller.request_checkpoint.remote()

    @train_api.post("/stop")
    async def stop(self) -> dict[str, Any]:
        return await self.controller.request_stop.remote()


def check_gpus(cfg: TrainConfig) -> None:
    """A GPU recipe (`trainer.use_gpu: true`) on a Ray cluster without GPUs fails here, before any actor starts,
    instead of its GPU actors waiting forever for resources. Outside Ray (config checks) there is nothing to ask."""
    if not cfg.trainer.use_gpu or not ray.is_initialized():
        return
    if not ray.cluster_resources().get("GPU"):
        raise ValueError("trainer.use_gpu is true but this Ray cluster has no GPU: run a CPU config instead "
                         "(serve_configs/train.yaml, serve_configs/<env>_cpu.yaml) or set trainer.use_gpu: false "
                         "and remove num_gpus from the Policy deployment")


def check_placement(cfg: TrainConfig) -> None:
    """Each set of resources in `placement` (with the CPUs or GPU it comes with) fits some alive node, and the
    Train workers fit as their placement group asks, or the run fails here, before any actor starts, instead of an
    actor waiting forever for a node. `placement.check_nodes: false` skips this (nodes that start on demand)."""
    if not cfg.placement.check_nodes or not ray.is_initialized():
        return
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    workers = cfg.trainer.num_workers
    worker = worker_resources(cfg.trainer, cfg.placement) or {"CPU": 1.0, "GPU": 1.0}
    wanted = {"controller": (cfg.placement.controller, 1),
              "env_actors": ({"CPU": cfg.rollout.env_actor_cpus, **cfg.placement.env_actors}, 1),
              "trainer": (worker, workers if cfg.placement.trainer_strategy == "STRICT_PACK" else 1)}
    for field, (need, times) in wanted.items():
        if not any(all(node.get(k, 0.0) >= v * times for k, v in need.items()) for node in nodes):
            have = [{k: v for k, v in node.items() if not k.startswith("node:") and k not in
                     ("memory", "object_store_memory")} for node in nodes]
            raise ValueError(f"invalid training config:\n  args.placement.{field}: no node of this Ray cluster "
                             f"has {need}{f' x {times} ({cfg.placement.trainer_strategy})' if times > 1 else ''};"
                             f" its nodes have {have} (placement.check_nodes: false if nodes start on demand)")
    fitting = sum(all(node.get(k, 0.0) >= v for k, v in worker.items()) for node in nodes)
    if cfg.placement.trainer_strategy == "STRICT_SPREAD" and fitting < workers:
        raise ValueError(f"invalid training config:\n  args.placement.trainer_strategy: STRICT_SPREAD needs "
                         f"{workers} nodes with {worker}; this Ray cluster has {fitting}")


def check_files_reach_every_node(cfg: TrainConfig) -> None:
    """A run's files (the starting model, its run folder and checkpoints) live on the disk of the node that wrote
    them; on a cluster of several nodes the run's actors and replicas land anywhere, so they must reach every node:
    through `checkpoint.storage`, or a disk every node mounts (`checkpoint.shared_disk`). Otherwise the run fails
    here, before any actor starts, naming what to set (nodes that join later are not known here: a path missing on
    one of them fails where it is read, naming the node)."""
    if cfg.checkpoint.storage is not None or cfg.checkpoint.shared_disk or not ray.is_initialized():
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1:
        raise ValueError(
            f"invalid training config:\n  args.checkpoint.storage: this Ray cluster has {len(nodes)} nodes and the "
            "run has no storage, so what it writes on one node's disk (the starting model, checkpoints) cannot reach "
            "the others. Set checkpoint.storage to a URI every node reaches (s3://bucket/runs, gs://bucket/runs, or "
            "a path on a disk every node mounts), or checkpoint.shared_disk: true if output_dir and the model cache "
            "(RAYGENT_CACHE, else ~/.cache/raygent) are on such a disk (docs/scaling-out.md)")


def shared_start(cfg: TrainConfig, model_path: str, resume_from: str | None, storage: Storage) -> str:
    """The model a run with `checkpoint.storage` starts from, as every node reads it: its URI in storage. A
    checkpoint is there already (copied when written; copied now if that failed), a local model folder is copied
    once, a storage URI or a hub id stays as it is. Nothing else of this node's disk reaches another node."""
    from_checkpoint = resume_from is not None and cfg.policy.lora is None
    if is_uri(cfg.policy.model) and not from_checkpoint:
        return cfg.policy.model  # in storage already
    if not Path(model_path).is_dir():
        return model_path  # a hub id: every node downloads it
    if from_checkpoint:
        checkpoint = Path(resume_from)
        if not storage.exists(f"checkpoints/{checkpoint.name}/{STORAGE_COMPLETE}"):
            mirror_checkpoint(cfg.run_dir, checkpoint, storage)
        return in_storage(model_path, cfg.run_dir, storage)
    return publish_start_model(model_path, storage)


def build_train_app(args: dict[str, Any]) -> serve.Application:
    """`serve run` entry. Validates the whole config (failing with each bad field's path and what is allowed), checks
    that a GPU config has GPUs, and resolves the starting weights (latest checkpoint of the run when `resume: auto`)
    before any actor starts."""
    cfg = load_train_config(args)
    check_gpus(cfg)
    check_placement(cfg)
    check_files_reach_every_node(cfg)
    storage = run_storage(cfg)
    resume_from = None
    if cfg.checkpoint.resume == "auto":
        latest = latest_checkpoint(cfg.run_dir)
        if latest is None and storage is not None:  # a fresh node (or pod): the run's checkpoints are in storage
            latest = fetch_latest_checkpoint(cfg.run_dir, storage)
            if latest is not None:
                # the `serve run` console: this process logs at the config's (quiet) Serve level
                print(f"raygent: fetched {latest.name} from {storage!r} to resume", flush=True)
        resume_from = str(latest) if latest else None
    elif cfg.checkpoint.resume != "never":
        resume_from = cfg.checkpoint.resume
    version = 0
    if resume_from is not None:
        state = load_state(Path(resume_from))
        version = int(state.get("weight_version", 0))
        if state.get("config") is not None:
            check_resume_config(state["config"], cfg.model_dump(mode="json"))
    if cfg.policy.lora is not None:
        # LoRA: everything starts from the base model (version 0); a resumed run's adapter reaches the replicas
        # from the controller, and the Train job's from the checkpoint's train_state.
        model_path, version = resolve_model(cfg.policy.model), 0
        try:
            check_targets(model_path, cfg.policy.lora)
        except ValueError as e:
            raise ValueError(f"invalid training config:\n  args.policy.lora.{e}") from None
    else:
        model_path = f"{resume_from}/model" if resume_from else resolve_model(cfg.policy.model)
    if storage is not None:
        model_path = shared_start(cfg, model_path, resume_from, storage)
    policy_cfg = cfg.policy.model_copy(update={"model": model_path, "initial_version": version,
                                               "sync_from": controller_name(cfg.run_name)}).model_dump()
    config = cfg.model_dump(mode="json")
    retriever = Retriever.bind(cfg.retriever.model_dump()) if cfg.retriever else None
    return TrainingRun.bind(Policy.bind(policy_cfg), config, model_path, resume_from, retriever)
