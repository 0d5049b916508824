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
import time
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.checkpoint import latest_checkpoint
from actors.config import TrainConfig, load_train_config
from actors.controller import Controller
from app.default_model import resolve_model
from app.policy import Policy
from app.retriever import Retriever

CONTROLLER_NAMESPACE = "raygent"
STATUS_TIMEOUT_S = 2.0  # /status answers within this even while the controller is busy starting

train_api = FastAPI(title="raygent training run", version="0.1")


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1)
@serve.ingress(train_api)
class TrainingRun:
    def __init__(self, policy: DeploymentHandle, config: dict[str, Any], model_path: str, resume_from: str | None,
                 retriever: DeploymentHandle | None = None):
        cfg = TrainConfig.model_validate(config)
        # Named and detached: a restarted ingress replica finds the running controller instead of starting a second
        # run; deleting the application (serve shutdown / Ctrl-C) ends it in __del__.
        self.controller = Controller.options(
            name=f"raygent-controller-{cfg.run_name}", namespace=CONTROLLER_NAMESPACE, lifetime="detached",
            get_if_exists=True).remote(config, policy, model_path, resume_from, retriever)
        self.controller.start.remote()
        self.started = time.time()

    def __del__(self):
        try:
            ray.kill(self.controller)
        except Exception:
            pass

    @train_api.get("/")
    @train_api.get("/status")
    async def status(self) -> dict[str, Any]:
        """The run's state; while the controller process is still coming up, that it is starting (at once)."""
        try:
            return await asyncio.wait_for(self.controller.status.remote(), timeout=STATUS_TIMEOUT_S)
        except asyncio.TimeoutError:
            return {"phase": "starting", "done": False, "detail": "the controller is starting",
                    "uptime_s": time.time() - self.started}

    @train_api.get("/metrics/history")
    async def history(self, since: int = 0) -> list[dict[str, Any]]:
        """Every logged record (from index `since`: a follower asks only for what is new)."""
        try:
            records = await asyncio.wait_for(self.controller.history.remote(), timeout=STATUS_TIMEOUT_S)
        except asyncio.TimeoutError:
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


def build_train_app(args: dict[str, Any]) -> serve.Application:
    """`serve run` entry. Validates the whole config (failing with each bad field's path and what is allowed), checks
    that a GPU config has GPUs, and resolves the starting weights (latest checkpoint of the run when `resume: auto`)
    before any actor starts."""
    cfg = load_train_config(args)
    check_gpus(cfg)
    resume_from = None
    if cfg.checkpoint.resume == "auto":
        latest = latest_checkpoint(cfg.run_dir)
        resume_from = str(latest) if latest else None
    elif cfg.checkpoint.resume != "never":
        resume_from = cfg.checkpoint.resume
    model_path = f"{resume_from}/model" if resume_from else resolve_model(cfg.policy.model)
    policy_cfg = cfg.policy.model_copy(update={"model": model_path}).model_dump()
    config = cfg.model_dump(mode="json")
    retriever = Retriever.bind(cfg.retriever.model_dump()) if cfg.retriever else None
    return TrainingRun.bind(Policy.bind(policy_cfg), config, model_path, resume_from, retriever)
