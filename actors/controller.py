"""The controller actor: runs a training run's iterations, owns the weight version, broadcasts new weights to every
policy replica, schedules validation and checkpoints, and answers status queries while it works.

One iteration, as a loop you can read top to bottom (`_iteration`):
  rollout (env-group actors x policy replicas; each group's block streams in and gets its advantages as it
  arrives) -> Ray Dataset of step records -> the long-lived Train job (one shard per worker) -> new weights
  -> broadcast -> log.
In async mode (`rollout.mode: async`) the same loop starts each rollout `max_staleness` iterations before its
update (`_train`), so the env-group actors keep producing while the Train job updates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray

import envs
from actors.batch import build_batch, split_for_workers
from actors.checkpoint import (
    adapter_of,
    base_model_weights,
    fetch_checkpoint,
    in_storage,
    latest_checkpoint,
    load_model_weights,
    load_state,
    mirror_checkpoint,
    reference_model_of,
    save_checkpoint,
    save_reference,
    train_state_of,
    write_model_template,
)
from actors.demonstrations import demo_players
from actors.env_group import EnvGroupActor, read_rollout
from actors.evaluation import summarize
from actors.lora import merge, read_adapter
from actors.metrics import MetricsSink, quiet_frameworks
from actors.storage import local_folder
from actors.trainer import TrainerFailure, TrainerGroup
from actors.weights import Weights, pack_weights
from algorithms import step_group_stats

logger = logging.getLogger("raygent")
HEARTBEAT_TIMEOUT_S = 120.0  # Serve health-checks the ingress every ~10 s
BROADCAST_TIMEOUT_S = 900.0  # an object-store update of every replica (requests in flight finish first)
GROUP_FAILURES_MAX = 3  # weight-group transfers failed in a row before the run keeps to the object store


def _pad_id(model_path: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _quiet_ray_data() -> None:
    """One console line per iteration is the run's progress display; Ray Data's own bars would bury it."""
    ray.data.DataContext.get_current().enable_progress_bars = False


def _setup_logging() -> None:
    if not any(getattr(h, "_raygent", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[raygent] %(message)s"))
        handler._raygent = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _serve_on_policy() -> str:
    """What Serve says about the Policy deployment's replicas (why they are not running), or that it says nothing."""
    from ray import serve

    try:
        for app in serve.status().applications.values():
            deployment = app.deployments.get("Policy")
            if deployment is not None and deployment.message:
                return f"Serve says: {deployment.message}"
    except Exception as e:
        return f"Serve's status is not available ({_why(e)})"
    return "Serve gives no reason (see the Serve log)"


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def overlap_share(spans: list[list[float | None]], start: float, end: float) -> float:
    """The share of [start, end] covered by the union of `spans` ([begin, end], end None while still running)."""
    covered, reach = 0.0, start
    for a, b in sorted((max(a, start), min(end if b is None else b, end)) for a, b in spans):
        if b > max(a, reach):
            covered += b - max(a, reach)
            reach = b
    return covered / max(end - start, 1e-9)


@ray.remote(num_cpus=0, max_restarts=0)
class Controller:
    def __init__(self, config: dict[str, Any], policy: Any, model_path: str, resume_from: str | None = None,
                 retriever: Any = None, config_hash: str = ""):
        from actors.config import TrainConfig

        self.cfg = TrainConfig.model_validate(config)
        _setup_logging()
        quiet_frameworks(self.cfg.logging.framework_level)
        _quiet_ray_data()
        self.config_dict = config
        self.policy = policy
        self.retriever = retriever
        self.model_path = model_path
        self.resume_from = Path(resume_from) if resume_from else None
        self.run_dir = self.cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.iteration = 0  # the next iteration to run
        self.version = 0
        self.phase = "starting"
        self.error: str | None = None
        self.last_metrics: dict[str, Any] = {}
        # The latest weights in the object store (checkpoints and (re)starting replicas read them) and their version:
        # every update's with weight_sync.backend object_store; on the collective path (gloo, nccl) the updates go
        # straight to the replicas and the Train job packs a copy only when one is needed (`_stored_weights`).
        self.latest_weights: Weights | None = None
        self._stored_version = -1
        self._sent_version: int | None = None  # the last version sent over a weight group
        # Held while the Train job's weights change and go out (an update, then its sync): the weights it holds are
        # of no version until then, so a copy for a new replica is packed only outside it.
        self._update_lock = asyncio.Lock()
        self._store_lock = asyncio.Lock()
        self._weight_store: Any = None  # the TCPStore where weight groups meet (hosted here, for the run)
        self._group: dict[str, Any] | None = None
        self._group_key: tuple = ()
        self.weight_sync_fallbacks = 0
        self._group_failures = 0  # transfers over the group that failed in a row
        self._base_weights: dict[str, Any] | None = None  # a LoRA run's base model, for merged checkpoints
        self.last_checkpoint: str | None = None
        self.warm_start_done = False
        self._stop = False
        self._checkpoint_waiters: list[asyncio.Future] = []
        self._checkpointed_version = -1
        self.restarts = 0
        self.replica_sync_failures = 0
        self.policy_replicas = self.replicas_updated = 0  # at the last sync check, and at the last broadcast
        self.checkpoint_failures = 0
        self.storage = self.cfg.checkpoint.run_storage(self.cfg.run_name)
        self.storage_failures = 0
        self.drained_rollouts = 0
        self._revivals: dict[int, asyncio.Lock] = {}
        self._rollout_spans: list[list[float | None]] = []  # [start, end or None while running]
        self._task: asyncio.Task | None = None
        self.started_at = time.time()
        self._config_hash = config_hash
        self.last_heartbeat = time.monotonic()

    # ---- control surface (called by the training app's HTTP routes) ------------------------------------------
    async def start(self) -> bool:
        """Start the run loop (and the watch on the application's heartbeats) once; later calls are no-ops."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._main())
            self._watch = asyncio.get_running_loop().create_task(self._watch_heartbeats())
            return True
        return False

    def config_hash(self) -> str:
        return self._config_hash

    def heartbeat(self) -> bool:
        """The application's ingress is alive (its health check calls this every few seconds)."""
        self.last_heartbeat = time.monotonic()
        return True

    async def _watch_heartbeats(self) -> None:
        """The controller lives as long as its application: with no heartbeat for HEARTBEAT_TIMEOUT_S (the app
        was deleted, or its ingress died and nobody restarted it), the run stops with a checkpoint and the actor
        exits."""
        while True:
            await asyncio.sleep(5.0)
            if time.monotonic() - self.last_heartbeat < HEARTBEAT_TIMEOUT_S:
                continue
            if self.phase not in ("done", "stopped", "failed"):
                logger.warning("no heartbeat from the application for %.0fs: stopping the run", HEARTBEAT_TIMEOUT_S)
                self._stop = True
                if self._task is not None:
                    await asyncio.wait([self._task], timeout=600)
            ray.kill(ray.get_runtime_context().current_actor)

    def status(self) -> dict[str, Any]:
        return {"run_name": self.cfg.run_name, "phase": self.phase, "iteration": self.iteration,
                "iterations": self.cfg.iterations, "weight_version": self.version,
                "done": self.phase in ("done", "stopped", "failed"), "error": self.error,
                "last_checkpoint": self.last_checkpoint, "run_dir": str(self.run_dir),
                "last_metrics": self.last_metrics, "uptime_s": time.time() - self.started_at}

    def history(self) -> list[dict[str, Any]]:
        return self.sink.records if hasattr(self, "sink") else []

    def request_stop(self) -> dict[str, Any]:
        """Graceful, in every phase: the running iteration (or warm-start chunk) finishes, a checkpoint is written,
        the trainer stops."""
        self._stop = True
        return {"stopping": True, "iteration": self.iteration, "phase": self.phase}

    async def request_checkpoint(self) -> dict[str, Any]:
        """A checkpoint at the end of the running iteration or warm-start chunk; once the run is over, the final
        checkpoint it wrote (the Train job is gone, and the weights have not changed since)."""
        if self.phase in ("done", "stopped", "failed"):
            return {"checkpoint": self.last_checkpoint, "note": f"the run is {self.phase}: its last checkpoint"}
        if not self._has_weights() and self.phase in ("starting", "baseline"):
            return {"checkpoint": self.last_checkpoint, "note": "no trained weights yet"}
        waiter = asyncio.get_running_loop().create_future()
        self._checkpoint_waiters.append(waiter)
        return {"checkpoint": str(await waiter)}

    async def _answer_checkpoint_requests(self) -> None:
        if self._checkpoint_waiters:
            path = await self._checkpoint()
            for w in self._checkpoint_waiters:
                if not w.done():
                    w.set_result(path)
            self._checkpoint_waiters.clear()

    # ---- the run ---------------------------------------------------------------------------------------------
    async def _main(self) -> None:
        try:
            await self._run()
        except Exception as e:
            self.phase, self.error = "failed", f"{type(e).__name__}: {e}"
            logger.exception("the run failed")
        finally:
            for w in self._checkpoint_waiters:
                if not w.done():
                    w.set_result(self.last_checkpoint)

    async def _setup(self) -> None:
        cfg = self.cfg
        resumed = None
        # The KL reference is the policy RL starts from: the starting model, replaced after a warm start; a resumed
        # run reads it from the checkpoint's state, never the resumed weights.
        self.reference_model = self.model_path
        if self.resume_from is not None and not self.resume_from.exists() and self.storage is not None:
            # this controller runs on another node than the one that chose the checkpoint: its copy in storage
            self.resume_from = await asyncio.to_thread(fetch_checkpoint, self.run_dir, self.resume_from.name,
                                                       self.storage)
        if self.resume_from is not None:
            resumed = load_state(self.resume_from)
            self.iteration, self.version = resumed["iteration"], resumed["weight_version"]
            self.warm_start_done = resumed.get("warm_start_done", False)
            self.last_checkpoint = str(self.resume_from)
            self.reference_model = reference_model_of(self.resume_from, resumed)
            logger.info("resuming %s from %s (next iteration %d; KL reference %s)", cfg.run_name, self.resume_from,
                        self.iteration, self.reference_model)
        # Blocking file and model work off the event loop: /status keeps answering while the run starts.
        self.sink = await asyncio.to_thread(MetricsSink, self.run_dir, cfg.run_name, cfg.logging, self.config_dict,
                                            self.iteration if resumed is not None else None)
        (self.run_dir / "config.json").write_text(json.dumps(self.config_dict, indent=2))
        # the starting model on this node (a storage URI is fetched into its cache)
        self.local_model = await asyncio.to_thread(local_folder, self.model_path)
        self.template = await asyncio.to_thread(write_model_template, self.local_model,
                                                self.run_dir / "model_template")
        pad_id = await asyncio.to_thread(_pad_id, self.local_model)
        if cfg.weight_sync.backend == "nccl":  # before anything starts: NCCL moves GPU memory only
            without = [i["replica_id"] for i in await self._replica_infos() if not i.get("cuda")]
            if without:
                raise RuntimeError(f"weight_sync.backend 'nccl': Policy replicas {without} have no GPU; give the "
                                   "Policy deployment ray_actor_options num_gpus (or use weight_sync.backend "
                                   "'object_store')")
        self.env_actors = [self._make_env_actor() for _ in range(cfg.rollout.num_env_actors)]
        await asyncio.gather(*(a.ready.remote() for a in self.env_actors))
        self.pad_id = pad_id
        # The Train job starts from the checkpoint it resumes (the replicas' start model may be an older one: a
        # controller started again by the health check resumes from the latest checkpoint).
        self.trainer = self._make_trainer(self._train_model(self.resume_from), self.resume_from)
        await asyncio.to_thread(self.trainer.start)
        await self._wait_for_replicas()
        # The replicas start from `model_path` under the version it was saved with (the training app passes the
        # resumed weight version as policy.initial_version); replicas that outlived an earlier controller of
        # this run hold later weights: they get the checkpoint's again, under a version above theirs.
        self._checkpointed_version = self.version
        if self.resume_from is not None:
            await self._restore_replicas(self.resume_from)

    async def _wait_for_replicas(self) -> None:
        """A Policy replica answers before the run goes on, or the run fails within rollout.policy_timeout_s with
        Serve's own word on why (e.g. the resources each replica asks for, which no node has), instead of every
        rollout waiting for replicas that never start."""
        deadline = time.monotonic() + self.cfg.rollout.policy_timeout_s
        while True:
            try:
                if await self._replica_infos():
                    return
            except Exception:  # none running yet (Serve may say so with an error)
                pass
            if time.monotonic() > deadline:
                reason = await asyncio.to_thread(_serve_on_policy)
                raise RuntimeError(f"no Policy replica answered within rollout.policy_timeout_s "
                                   f"({self.cfg.rollout.policy_timeout_s:.0f}s): {reason}; check the Policy "
                                   "deployment's ray_actor_options (resources, num_gpus) against the cluster's nodes")
            await asyncio.sleep(2.0)

    def _train_model(self, checkpoint: Path | None) -> str:
        """The HF folder a Train job starts from: the checkpoint's model, or the starting one. A LoRA run's job
        always builds on the base model; its adapter (and the base) come back from the checkpoint's train_state."""
        if checkpoint is None or self.cfg.policy.lora is not None:
            return self.model_path
        return self._shared(str(checkpoint / "model"))

    def _shared(self, folder: str) -> str:
        """A folder of the run folder as a process on another node reads it: through storage, when the run has it."""
        return in_storage(folder, self.run_dir, self.storage)

    def _make_trainer(self, model_path: str, checkpoint: Path | None) -> TrainerGroup:
        cfg = self.cfg
        return TrainerGroup(cfg.run_name, str(self.run_dir), cfg.trainer, {
            "model_path": model_path, "ref_model_path": self._shared(self.reference_model),
            "optim": cfg.optim.model_dump(),
            "seed": cfg.seed, "pad_id": self.pad_id, "norm_length": cfg.loss_norm_length, "iterations": cfg.iterations,
            "mixed_precision": cfg.trainer.mixed_precision, "weights_dtype": cfg.policy.dtype,
            "weights_bucket_bytes": cfg.weight_sync.bucket_bytes,
            "activation_checkpointing": cfg.trainer.activation_checkpointing,
            "lora": cfg.policy.lora.model_dump() if cfg.policy.lora else None,
            "framework_log_level": cfg.logging.framework_level,
            **{k: self._shared(v) for k, v in train_state_of(checkpoint).items()},
        }, cfg.placement)

    async def _recover_trainer(self, error: TrainerFailure) -> None:
        """The Train job failed or hung: start a new one from the last checkpoint (model and optimizer), roll the
        run back to that checkpoint's iteration (its metrics after it are cut, the iterations are redone) and put
        its weights (without a checkpoint: the starting ones, as the new job holds them) on every replica under a
        new, higher version. Under the update lock: until then no weights of the run have a version."""
        async with self._update_lock:
            await self._restart_trainer(error)

    async def _restart_trainer(self, error: TrainerFailure) -> None:
        self.restarts += 1
        if self.restarts > self.cfg.trainer.max_restarts:
            raise RuntimeError(f"the Train job failed {self.restarts} times (trainer.max_restarts "
                               f"{self.cfg.trainer.max_restarts}); last: {error}") from error
        checkpoint = latest_checkpoint(self.run_dir)
        logger.warning("the Train job failed (%s); restart %d/%d from %s", str(error).splitlines()[0][:300],
                       self.restarts, self.cfg.trainer.max_restarts, checkpoint or "the starting model")
        self.phase = "recovering"
        if checkpoint is not None:
            state = load_state(checkpoint)
            self.iteration, self.warm_start_done = state["iteration"], state.get("warm_start_done", False)
        else:  # nothing checkpointed yet: from the start (the warm start, if any, runs again)
            self.iteration, self.warm_start_done = 0, False
        self.sink.truncate(self.iteration)
        self.trainer = self._make_trainer(self._train_model(checkpoint), checkpoint)
        await asyncio.to_thread(self.trainer.start)
        if checkpoint is not None:  # the lost job owned the latest weights: the checkpoint's, owned here
            await self._restore_replicas(checkpoint, always=True)
        elif self._has_weights():  # the replicas may hold the lost job's weights: the new job's go out instead
            results = await self.trainer.run({"kind": "pack_weights", "want_weights": True})
            infos = await self.policy.broadcast("info").results_async(return_exceptions=True)
            self.version = max([self.version, *(i["version"] for i in infos if isinstance(i, dict))])
            await self._broadcast(results[0]["weights"])
        self._log({"iteration": self.iteration, "phase": "fault", "faults/trainer_restarts": self.restarts,
                   "faults/restored_from": str(checkpoint) if checkpoint else None})

    async def _restore_replicas(self, checkpoint: Path, always: bool = False) -> None:
        """Put a checkpoint's weights on every replica (held by this controller, not by a Train worker that may be
        gone), under a version above every replica's, unless they all hold that checkpoint's version already."""
        infos = await self.policy.broadcast("info").results_async(return_exceptions=True)
        versions = [i["version"] for i in infos if isinstance(i, dict)]
        if not always and versions and all(v == self.version for v in versions):
            return
        weights = await asyncio.to_thread(self._pack_checkpoint, Path(checkpoint))
        self.version = max([self.version, *versions])
        await self._broadcast(weights)
        self._checkpointed_version = self.version

    def _pack_checkpoint(self, checkpoint: Path) -> Weights:
        """A checkpoint's weights (a LoRA run's: its adapter), held by this controller, packed as the Train job
        packs its own."""
        adapter = adapter_of(checkpoint)
        if self.cfg.policy.lora is not None and adapter is not None:
            return pack_weights(read_adapter(adapter)[0].items(), self.cfg.policy.dtype,
                                self.cfg.weight_sync.bucket_bytes, kind="adapter")
        return pack_weights(load_model_weights(checkpoint / "model").items(), self.cfg.policy.dtype,
                            self.cfg.weight_sync.bucket_bytes)

    def _full_weights(self, weights: Weights, tensors: dict[str, Any]) -> dict[str, Any]:
        """The whole model's weights of `weights` (whose `tensors` are given): as they are, or a LoRA adapter merged
        into the base model (read once, kept for the next checkpoint)."""
        if weights.kind != "adapter":
            return tensors
        if self._base_weights is None:
            self._base_weights = base_model_weights(self.local_model)
        return merge(self._base_weights, tensors, self.cfg.policy.lora.scale)

    async def latest_weights_for_replica(self) -> dict[str, Any] | None:
        """What a (re)starting policy replica loads before it serves: the latest weights and their version (None
        before any). On the collective path the Train job packs them now, after the update under way (if any) has
        gone out; if that fails, the replica starts behind and the sync check before the next rollout catches it
        up."""
        if not self._has_weights():
            return None
        if self._stored_version != self.version:
            try:  # no deadline here: the replica has its own, and a pack left half-awaited would pin its copy
                async with self._update_lock:
                    await self._stored_weights()
            except TrainerFailure:
                return None
        if self.latest_weights is None or self._stored_version != self.version:
            return None
        return {"version": self.version, "weights": self.latest_weights}

    def _has_weights(self) -> bool:
        """Whether the run has put weights on the replicas (trained or restored from a checkpoint)."""
        return self.latest_weights is not None or self._sent_version is not None

    async def _stored_weights(self) -> Weights:
        """The current version's weights in the object store: those of the last broadcast, or on the collective path
        packed by the Train job, which holds the current version's weights between updates."""
        async with self._store_lock:
            if self.latest_weights is None or self._stored_version != self.version:
                version = self.version
                results = await self.trainer.run({"kind": "pack_weights", "want_weights": True})
                if self.version == version:  # else a restore or broadcast has put newer ones there meanwhile
                    self.latest_weights, self._stored_version = results[0]["weights"], version
            return self.latest_weights

    def _make_env_actor(self):
        cfg = self.cfg
        return EnvGroupActor.options(num_cpus=cfg.rollout.env_actor_cpus, resources=cfg.placement.env_actors,
                                     runtime_env={"env_vars": {
            "RAYGENT_FRAMEWORK_LOG_LEVEL": cfg.logging.framework_level}}).remote(
            cfg.env.name, cfg.env_kwargs, cfg.memory.name, cfg.memory.kwargs, self.model_path, self.policy,
            cfg.policy.max_model_len, self.retriever, cfg.rollout.policy_timeout_s)

    async def _run(self) -> None:
        cfg = self.cfg
        await self._setup()
        self.phase = "baseline"
        val_seeds = envs.group_seeds(cfg.seed, 0, cfg.validation.n_envs, "val")
        if self.iteration == 0 and not self.warm_start_done:
            random_success = await self.env_actors[0].random_policy_success.remote(
                val_seeds.tolist(), cfg.seed, cfg.validation_env_kwargs)
            self._log({"iteration": 0, "phase": "baseline", "val/random_policy_success": random_success})
            logger.info("random admissible-action policy: %.1f%% success on %d held-out seeds",
                        100 * random_success, len(val_seeds))
            baseline_envs = cfg.validation.baseline_envs
            baseline_envs = cfg.validation.n_envs if baseline_envs is None else baseline_envs
            if cfg.validation.every and baseline_envs:
                # An untrained policy writes max_tokens of noise at every step of every episode: the costliest
                # validation of a run, for a number that is usually 0; a subset of the seeds can tell.
                await self._validate(val_seeds[:baseline_envs], tag="untrained")
        while True:  # a failed Train job is restarted from the last checkpoint and the run goes on from there
            try:
                if cfg.warm_start.enabled and not self.warm_start_done and not self._stop:
                    await self._warm_start(val_seeds)
                await self._train(val_seeds)
                break
            except TrainerFailure as e:
                failure: TrainerFailure | None = e
                while failure is not None:  # a new job that fails at once is restarted too (max_restarts bounds it)
                    try:
                        await self._recover_trainer(failure)
                        failure = None
                    except TrainerFailure as again:
                        failure = again
        if self._has_weights() and self._checkpointed_version != self.version:
            await self._checkpoint()  # stopped before any RL iteration: what the warm start made is kept
        await self._answer_checkpoint_requests()
        await self.trainer.stop()
        self.phase = "stopped" if self._stop and self.iteration < cfg.iterations else "done"
        self.sink.close()
        logger.info("run %s %s after %d iterations; checkpoint: %s. Serve it: serve run "
                    "app.agent:build_agent_app model=%s/model", cfg.run_name, self.phase, self.iteration,
                    self.last_checkpoint, self.last_checkpoint)

    async def _train(self, val_seeds: np.ndarray) -> None:
        """The RL iterations. The rollout of iteration r starts `lookahead` iterations before its update (0 in sync
        mode; max_staleness in async, so the rollouts of the next iterations run while this one trains): its rows
        then lag the trainer's weights by at most that many versions."""
        cfg = self.cfg
        self.phase = "training"
        ahead = cfg.rollout.lookahead
        rollouts: dict[int, asyncio.Task] = {}
        try:
            while self.iteration < cfg.iterations and not self._stop:
                it = self.iteration
                await self._sync_replicas()
                for r in range(it, min(it + ahead + 1, cfg.iterations)):
                    if r not in rollouts:
                        rollouts[r] = asyncio.get_running_loop().create_task(self._rollout(r))
                record = await self._iteration(it, rollouts.pop(it))
                self.iteration = it + 1
                last = self.iteration == cfg.iterations
                if cfg.validation.every and (last or self.iteration % cfg.validation.every == 0):
                    record.update(await self._validate(val_seeds, log=False))
                checkpointed = last or self._stop or (cfg.checkpoint.every and self.iteration % cfg.checkpoint.every == 0)
                if checkpointed:
                    t0 = time.perf_counter()
                    await self._checkpoint()
                    record["time/checkpoint_s"] = time.perf_counter() - t0
                await self._answer_checkpoint_requests()
                self._log(record)
                if checkpointed and self.storage is not None:  # the history in storage includes this iteration
                    await self._to_storage("metrics.jsonl", self.storage.upload,
                                           self.run_dir / "metrics.jsonl", "metrics.jsonl")
                self._print_line(record)
        finally:
            await self._drain(rollouts)

    async def _drain(self, rollouts: dict[int, asyncio.Task]) -> None:
        """Rollouts started for iterations that will not train here (a stop, or a Train job restart that rolls the
        run back): their episodes finish, so no env or replica is left mid-episode, and their rows are not trained
        (a resume redoes those iterations)."""
        if not rollouts:
            return
        logger.info("draining %d rollouts started ahead (iterations %s); their rows are not trained",
                    len(rollouts), sorted(r + 1 for r in rollouts))
        _, late = await asyncio.wait(list(rollouts.values()), timeout=2 * self.cfg.rollout.policy_timeout_s)
        for task in late:
            task.cancel()
        self.drained_rollouts += len(rollouts)

    # ---- one iteration ---------------------------------------------------------------------------------------
    async def _iteration(self, it: int, rollout: asyncio.Task) -> dict[str, Any]:
        """Wait for iteration `it`'s rollout, build its batch, update, broadcast; in async mode the rollouts of
        later iterations run meanwhile, and the share of the update they overlap is logged."""
        cfg = self.cfg
        t_start = time.perf_counter()
        self.phase = "rollout"
        prepared, roll, (roll_start, roll_end) = await rollout
        t_rollout = time.perf_counter()
        self.phase = "learning"
        record: dict[str, Any] = {"iteration": it + 1, "phase": "train", **self._rollout_metrics(roll, "train")}
        if not prepared:
            logger.error("iteration %d: every env-group actor failed; nothing to train on", it)
            return record
        # Ray Data calls block on tasks (block metadata, materialize, split): off the event loop, so /status answers.
        ds, summary, shards = await asyncio.to_thread(self._build_dataset, prepared)
        if ds is None:
            logger.warning("iteration %d: %d rows after filtering; skipping the update", it, len(summary))
            return record
        t_data = time.perf_counter()
        stats = step_group_stats(summary["group_id"].to_numpy(), summary["anchor"].to_numpy())
        record.update({"data/rows": len(summary), "data/step_group_share": stats["step_group_share"],
                       "data/step_group_mean_size": stats["step_group_mean_size"],
                       "data/advantage_abs_mean": float(np.abs(summary["advantage"]).mean()),
                       "data/advantage_std": float(summary["advantage"].std()),
                       **self._group_checks(summary)})
        async with self._update_lock:
            results = await self.trainer.run({"kind": "rl", "shards": shards, "iteration": it,
                                              "want_weights": self._via_object_store, "version": self.version,
                                              "max_staleness": cfg.rollout.lookahead})
            t_train = time.perf_counter()
            record.update({f"train/{k}": v for k, v in results[0]["metrics"].items()})
            await self._publish(results)
        t_end = time.perf_counter()
        record.update({"weight_version": self.version, "time/rollout_s": roll_end - roll_start,
                       "time/rollout_wait_s": t_rollout - t_start, "time/dataset_s": t_data - t_rollout,
                       "time/train_s": t_train - t_data, "time/broadcast_s": t_end - t_train,
                       "time/iteration_s": t_end - t_start,
                       "perf/overlap_share": self._overlap(t_data, t_train),
                       "perf/policy_replicas": self.policy_replicas, "perf/replicas_updated": self.replicas_updated,
                       "faults/weight_sync_fallbacks": self.weight_sync_fallbacks,
                       "faults/drained_rollouts": self.drained_rollouts})
        return record

    def _overlap(self, start: float, end: float) -> float:
        """The share of [start, end] (an update) during which some rollout was running."""
        share = overlap_share(self._rollout_spans, start, end)
        # the same span objects stay: a running rollout sets its end in place
        self._rollout_spans = [s for s in self._rollout_spans if s[1] is None or s[1] > end]
        return share

    def _build_dataset(self, prepared: list[Any]):
        """The iteration's Dataset from its prepared group blocks (`actors.batch`: whole-batch statistics merged
        from the blocks), then one shard per training worker, no row dropped."""
        ds = build_batch(prepared, self.cfg.algorithm)
        summary = ds.select_columns(["group_id", "traj_id", "anchor", "advantage", "weight_version"]).to_pandas()
        if len(summary) == 0:
            return None, summary, None
        return ds, summary, split_for_workers(ds, self.cfg.trainer.num_workers)

    def _group_checks(self, summary: Any) -> dict[str, int]:
        """What the batch's groups hold: groups that lack a trajectory (must be 0: a group trains whole or not at
        all) and groups whose rows span weight versions (async mode: an update landed mid-episode)."""
        per_group = summary.groupby("group_id").agg(trajs=("traj_id", "nunique"), versions=("weight_version",
                                                                                            "nunique"))
        return {"data/groups": len(per_group),
                "data/incomplete_groups": int((per_group["trajs"] != self.cfg.rollout.group_size).sum()),
                "data/mixed_version_groups": int((per_group["versions"] > 1).sum())}

    def _sampling(self, temperature: float) -> dict[str, Any]:
        r = self.cfg.rollout
        return {"temperature": temperature, "top_p": r.top_p, "max_tokens": r.max_tokens}

    async def _on_actors(self, n: int, call: Any, what: str,
                         pending: Any = None) -> tuple[list[Any], list[int]]:
        """Spread items 0..n-1 over the env-group actors: `call(actor, part)` for each slice. A failed actor's slice
        is redone once on the restarted actor, then dropped and counted: the run goes on with what the others
        produced. `pending(part)`: the items of a slice still to do (a streamed rollout keeps the groups a failed
        actor finished, and its `call` plays only the rest). Returns the results of the calls that finished and
        (redone, dropped) item counts."""
        slices = [s for s in np.array_split(np.arange(n), len(self.env_actors)) if len(s)]
        faults = [0, 0]

        async def one(k: int, part: np.ndarray):
            for attempt in range(2):
                try:
                    return await call(self.env_actors[k], part)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                    lost = len(part if pending is None else pending(part))
                    logger.warning("env-group actor %d failed (%s); %s %d of its %d %s", k, type(e).__name__,
                                   "redoing" if attempt == 0 else "dropping", lost, len(part), what)
                    faults[0 if attempt == 0 else 1] += lost
                    if isinstance(e, ray.exceptions.RayActorError):
                        await self._revive_env_actor(k)
            return None

        done = await asyncio.gather(*(one(k, part) for k, part in enumerate(slices)))
        return [d for d in done if d is not None], faults

    async def _rollout(self, it: int) -> tuple[list[Any], list[dict[str, Any]], tuple[float, float]]:
        """Iteration `it`'s groups, spread over the env-group actors. Each group's block streams back as the group
        finishes, prepared for the trainer by its actor (`actors.batch.prepare_block`: its advantages) while the
        other groups still play. Returns the prepared blocks (object refs, never fetched here), the rollout's
        metrics (one record per group and per actor), and when it ran."""
        cfg = self.cfg
        seeds = envs.group_seeds(cfg.seed, it, cfg.rollout.n_groups, "train")
        # In sync mode every row must come from the weights of this moment (a replica on others is counted, and
        # its groups left out); in async mode versions move during the rollout and the trainer checks each row's.
        expected = self.version if cfg.rollout.mode == "sync" else None
        span = [time.perf_counter(), None]
        self._rollout_spans.append(span)
        prepared: dict[int, Any] = {}
        parts: list[dict[str, Any]] = []

        def on_group(head: dict[str, Any], block: Any) -> None:
            prepared[head["group"]] = block
            parts.append(head)

        def pending(part: np.ndarray) -> np.ndarray:
            return np.array([g for g in part if g not in prepared], dtype=np.int64)

        async def call(actor: Any, part: np.ndarray):
            todo = pending(part)  # a redo plays only the groups the failed actor had not finished
            if not len(todo):
                return
            stream = actor.rollout.remote(
                seeds[todo].tolist(), todo.tolist(), cfg.rollout.group_size, self._sampling(cfg.rollout.temperature),
                cfg.rollout.requests_per_step, cfg.seed, it, expected, cfg.rollout.route_by_group, cfg.algorithm)
            parts.append(await read_rollout(stream, on_group))

        try:
            _, faults = await self._on_actors(len(seeds), call, "groups", pending)
        finally:
            span[1] = time.perf_counter()
        # the rollout's own span times it (an actor that failed sent no closing record with its seconds)
        parts.append({"rerolled_groups": faults[0], "dropped_groups": faults[1], "seconds": span[1] - span[0]})
        return [prepared[g] for g in sorted(prepared)], parts, (span[0], span[1])

    async def _revive_env_actor(self, k: int) -> None:
        """Wait for Ray to restart the actor (max_restarts=-1); replace it if it cannot come back. One revival per
        actor at a time: in async mode two rollouts may have lost the same actor."""
        async with self._revivals.setdefault(k, asyncio.Lock()):
            try:
                await asyncio.wait_for(self.env_actors[k].ready.remote(), timeout=60)
            except Exception:
                self.env_actors[k] = self._make_env_actor()
                await asyncio.wait_for(self.env_actors[k].ready.remote(), timeout=300)

    def _rollout_metrics(self, parts: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
        def total(key: str) -> float:
            return float(sum(p.get(key, 0) for p in parts))

        episodes, steps = max(total("episodes"), 1), max(total("steps"), 1)
        seconds = max(max((p.get("seconds", 0.0) for p in parts), default=0.0), 1e-9)
        out = {f"{prefix}/success_rate": total("won") / episodes, f"{prefix}/return": total("return_sum") / episodes,
               f"{prefix}/episode_length": total("steps") / episodes,
               f"{prefix}/valid_action_ratio": total("valid_steps") / steps, f"{prefix}/episodes": int(total("episodes"))}
        if prefix == "train":
            out.update({"perf/env_steps_per_s": total("steps") / seconds,
                        # the slowest actor's time waiting on the policy: generation as the rollout saw it
                        "time/generate_s": max((p.get("generate_seconds", 0.0) for p in parts), default=0.0),
                        "perf/tokens_per_s": total("generated_tokens") / seconds,
                        "perf/prompt_tokens_per_step": total("prompt_tokens") / steps,
                        # a trajectory's steps kept on one replica (`rollout.route_by_group`): its prefix cache hits
                        "perf/same_replica_share": total("same_replica_steps") / max(total("later_steps"), 1),
                        # replicas that answered this rollout (autoscaling adds and removes them mid-run)
                        "perf/replicas_answering": len({r for p in parts for r in p.get("replica_steps", {})}),
                        "faults/rerolled_groups": int(total("rerolled_groups")),
                        "faults/dropped_groups": int(total("dropped_groups")),
                        "faults/prompt_too_long": int(total("prompt_too_long")),
                        "faults/env_errors": int(total("env_errors")),
                        "faults/stale_rows": int(total("stale_rows")),
                        "faults/replica_sync_failures": self.replica_sync_failures,
                        "faults/checkpoint_failures": self.checkpoint_failures,
                        "faults/storage_failures": self.storage_failures})
        return out

    async def _validate(self, val_seeds: np.ndarray, tag: str = "val", log: bool = True) -> dict[str, Any]:
        """The held-out evaluation (`actors.evaluation`, as `raygent eval` runs it) spread over the actors."""
        prev, self.phase = self.phase, "validating"
        t0 = time.perf_counter()
        cfg = self.cfg
        val_kwargs = cfg.validation_env_kwargs

        async def call(actor: Any, part: np.ndarray):
            return await actor.evaluate.remote(val_seeds[part].tolist(), cfg.validation.samples,
                                               self._sampling(cfg.validation.temperature), val_kwargs, cfg.seed,
                                               int(part[0]))

        parts, faults = await self._on_actors(len(val_seeds), call, "held-out seeds")
        report = summarize([r for part in parts for r in part])
        record = {f"val/{k}": v for k, v in report.items() if k != "per_task"}
        for task, numbers in report.get("per_task", {}).items():
            record[f"val/{task}/success_rate"] = numbers["success_rate"]
        record["faults/dropped_val_seeds"] = faults[1]
        record["time/validation_s"] = time.perf_counter() - t0
        self.phase = prev
        if log:
            self._log({"iteration": self.iteration, "phase": tag, **record})
            logger.info("validation (%s): success %.1f%%, return %.2f, valid actions %.1f%%", tag,
                        100 * record["val/success_rate"], record["val/return"], 100 * record["val/valid_action_ratio"])
        return record

    async def _sync_replicas(self) -> None:
        """Before a rollout: every replica on the latest weights. A replica that restarted and could not sync
        itself from the run, or missed a broadcast, gets them again (under a new version, so nothing rolls back)."""
        try:
            infos = await asyncio.wait_for(
                self.policy.broadcast("info").results_async(return_exceptions=True), timeout=120)
        except asyncio.TimeoutError:
            infos = [None]
        versions = [i["version"] if isinstance(i, dict) else None for i in infos]
        self.policy_replicas = sum(isinstance(i, dict) for i in infos)
        if self._has_weights() and any(v is not None and v != self.version for v in versions):
            logger.warning("replica versions %s differ from %d: re-broadcasting", versions, self.version)
            if self._via_object_store:
                await self._broadcast(await self._stored_weights())
            else:
                async with self._update_lock:
                    await self._send_over_group()

    @property
    def _via_object_store(self) -> bool:
        """Whether updates go through the object store: the configured backend, or the collective one after it
        failed GROUP_FAILURES_MAX times in a row (each failure costs up to weight_sync.timeout_s)."""
        return self.cfg.weight_sync.backend == "object_store" or self._group_failures >= GROUP_FAILURES_MAX

    async def _publish(self, results: list[Any]) -> None:
        """The weights the Train job has just made, to every replica under the next version."""
        if self._via_object_store:
            await self._broadcast(results[0]["weights"])
        else:
            await self._send_over_group()

    async def _replica_infos(self) -> list[dict[str, Any]]:
        infos = await asyncio.wait_for(self.policy.broadcast("info").results_async(return_exceptions=True), 120)
        return [i for i in infos if isinstance(i, dict)]

    def _weight_group(self, members: list[str]) -> dict[str, Any]:
        """The weight group of this Train job and these replicas: the one formed before, or a new one (a replica
        came or went, the job restarted, or the last transfer failed). Its members meet at a TCPStore hosted here."""
        import uuid

        import torch.distributed as dist

        from actors.weights import GroupSpec

        key = (self.trainer.job_id, tuple(members))
        if self._group is None or self._group_key != key:
            host = ray.util.get_node_ip_address()
            if self._weight_store is None:
                self._weight_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            ranks = {replica: rank for rank, replica in enumerate(members, start=1)}
            self._group = GroupSpec(f"raygent-weights-{uuid.uuid4().hex[:8]}", host, self._weight_store.port,
                                    self.cfg.weight_sync.backend, self.cfg.weight_sync.timeout_s, ranks).to_dict()
            self._group_key = key
        return self._group

    async def _send_over_group(self) -> None:
        """The collective path (weight_sync.backend gloo / nccl): Train rank 0 broadcasts the weights it holds to
        every replica's engine under the next version, nothing through the object store. A replica that starts
        after the group formed is not in it (the next sync check catches it up). A transfer that fails (a member
        gone: each operation has weight_sync.timeout_s) is counted, and the weights go through the object store
        instead."""
        try:
            members = sorted(i["replica_id"] for i in await self._replica_infos())
        except Exception as e:  # no replica reachable now: the object store path counts what it can reach
            logger.warning("no replica answered before a weight update (%s)", _why(e))
            members = []
        self.version += 1
        failure = await self._transfer(members) if members else "no replica answered"
        if failure is None:
            self._sent_version, self._group_failures = self.version, 0
            if self._stored_version != self.version:
                self.latest_weights = None  # an older copy: no reason to keep it in the object store
            return
        self._group = None  # its state is unknown: the next transfer forms a new one
        self.weight_sync_fallbacks += 1
        self._group_failures += 1
        logger.warning("weight version %d over the %s group failed (%s); sending it through the object store%s",
                       self.version, self.cfg.weight_sync.backend, failure,
                       f", and every later update too ({GROUP_FAILURES_MAX} failures in a row)"
                       if self._via_object_store else "")
        results = await self.trainer.run({"kind": "pack_weights", "want_weights": True})
        await self._broadcast(results[0]["weights"])

    async def _transfer(self, members: list[str]) -> str | None:
        """One transfer of the current version over the group of these replicas; None, or what failed. The sender's
        operations each have a deadline, so its task ends; the receivers then get `timeout_s` to finish loading."""
        group = self._weight_group(members)
        send = asyncio.ensure_future(self.trainer.run({"kind": "send_weights", "group": group,
                                                       "version": self.version}))
        receive = asyncio.ensure_future(
            self.policy.broadcast("receive_weights", group, self.version).results_async(return_exceptions=True))
        await asyncio.wait({send, receive}, return_when=asyncio.FIRST_COMPLETED)
        if not send.done():  # the replicas answered first (or could not be called): the sender ends on its own
            await asyncio.wait({send})
        if send.exception() is not None:  # the Train job failed: the run restarts it
            receive.add_done_callback(lambda f: f.exception())  # its members give up on their own
            raise send.exception()
        sent = send.result()[0]["metrics"]
        try:  # the sender is done, so every bucket has left: the replicas only finish loading
            received = await asyncio.wait_for(receive, self.cfg.weight_sync.timeout_s)
        except asyncio.TimeoutError:
            return f"replicas still loading {self.cfg.weight_sync.timeout_s:.0f}s after the sender finished"
        except Exception as e:
            return f"the replicas could not be called: {_why(e)}"
        took = {r["replica_id"] for r in received if isinstance(r, dict) and r.get("member")}
        self.replicas_updated = len(took)
        failed = [r for r in received if isinstance(r, BaseException)]
        if sent.get("send_error") or took != set(group["ranks"]):
            self.replica_sync_failures += len(set(group["ranks"]) - took)
            return (f"sender: {sent.get('send_error', 'ok')}; {len(set(group['ranks']) - took)} of "
                    f"{len(group['ranks'])} replicas did not take it"
                    + (f" ({_why(failed[0])})" if failed else ""))
        return None

    async def _broadcast(self, weights: Weights) -> None:
        """New weights to every replica under the next version. A replica that fails to take them is logged and
        counted, and stays behind: the next sync check retries it, and until then its rows are dropped as stale."""
        self.version += 1
        self.latest_weights, self._stored_version = weights, self.version
        try:  # a replica that never answers (its engine stuck) must not hold the run: it counts as failed
            results = await asyncio.wait_for(self.policy.broadcast("update_weights", weights, self.version)
                                             .results_async(return_exceptions=True), BROADCAST_TIMEOUT_S)
        except asyncio.TimeoutError as e:
            results = [e]
        failed = [r for r in results if isinstance(r, BaseException)]
        self.replicas_updated = len(results) - len(failed)
        if failed:
            self.replica_sync_failures += len(failed)
            logger.warning("%d of %d replicas did not take weight version %d: %s", len(failed), len(results),
                           self.version, _why(failed[0]))

    async def _checkpoint(self) -> Path | None:
        """A checkpoint of the current weights, optimizer and run state; a disk that refuses it (full, read-only) is
        logged and counted, the previous checkpoint stays intact, and the run goes on."""
        prev = self.phase
        try:
            path = await self._write_checkpoint()
            if self.storage is not None:
                await self._to_storage(path.name, mirror_checkpoint, self.run_dir, path, self.storage)
            return path
        except OSError as e:
            self.checkpoint_failures += 1
            logger.error("checkpoint of iteration %d failed (%s); the last one stays %s", self.iteration, e,
                         self.last_checkpoint)
            return Path(self.last_checkpoint) if self.last_checkpoint else None
        finally:
            self.phase = prev

    async def _to_storage(self, what: str, copy: Callable[..., None], *args: Any) -> None:
        """A copy to `checkpoint.storage` (a checkpoint, the metrics); storage that refuses it (unreachable, full) is
        logged and counted, the file stays in the run folder, and the run goes on."""
        try:
            await asyncio.to_thread(copy, *args)
        except OSError as e:
            self.storage_failures += 1
            logger.error("copying %s to %r failed (%s); it stays in %s", what, self.storage,
                         str(e).splitlines()[0][:300], self.run_dir)

    async def _write_checkpoint(self) -> Path:
        self.phase = "checkpointing"
        lora = self.cfg.policy.lora
        stored = await self._stored_weights()
        tensors = await asyncio.to_thread(stored.state_dict)
        weights = await asyncio.to_thread(self._full_weights, stored, tensors)
        adapter = tensors if lora is not None else None
        state = {"iteration": self.iteration, "weight_version": self.version, "seed": self.cfg.seed,
                 "warm_start_done": self.warm_start_done, "run_name": self.cfg.run_name, "time": time.time(),
                 "reference_model": self.reference_model, "config": self.config_dict,
                 **({"base_model": self.model_path} if lora is not None else {})}

        async def save_train_state(path: str) -> None:
            # Ranks on other nodes write their shards on their own disks, then into `stage` in storage; they are
            # collected into this node's checkpoint here.
            stage = f"staging/{Path(path).parent.name}"
            results = await self.trainer.run({
                "kind": "save_train_state", "path": path, "node": ray.get_runtime_context().get_node_id(),
                "stage": self.storage.uri_of(stage) if self.storage is not None else None})
            if results[0].get("write_error"):
                raise OSError(results[0]["write_error"])
            if self.storage is not None and await asyncio.to_thread(self.storage.exists, stage):
                await asyncio.to_thread(self.storage.download_into, stage, path)
                await asyncio.to_thread(self.storage.delete, stage)
            if not (Path(path) / ".metadata").is_file():
                raise OSError(f"the Train job's state is not all in {path}: a rank on another node wrote it there "
                              "on its own disk; set checkpoint.storage so its shards reach this node")

        card = self.cfg.agent_card(iteration=self.iteration, weight_version=self.version,
                                   warm_start_done=self.warm_start_done, base_model=self.cfg.policy.model)
        path = await save_checkpoint(self.run_dir, self.iteration, weights, self.template, state,
                                     self.cfg.checkpoint.keep, save_train_state, card, self._pinned(), adapter, lora)
        self.last_checkpoint = str(path)
        self._checkpointed_version = self.version
        return path

    def _pinned(self) -> set[Path]:
        """Checkpoints rotation must keep while this run lives: the one it resumed from, and the one the policy
        replicas and env-group actors load their starting model from (a restart reads it again)."""
        pinned = {self.resume_from} if self.resume_from else set()
        start = Path(self.model_path.partition("?")[0])  # a local folder, or its copy in storage
        if start.name == "model" and start.parent.parent.name == "checkpoints":
            pinned.add(self.run_dir / "checkpoints" / start.parent.name)
        return pinned

    # ---- supervised warm start -------------------------------------------------------------------------------
    async def _warm_start(self, val_seeds: np.ndarray) -> None:
        from ray.experimental.tqdm_ray import tqdm

        ws = self.cfg.warm_start
        self.phase = "warm_start"
        players = demo_players(self.cfg.seed, ws.demo_seeds, len(self.env_actors))
        calls = [a.demonstrations.remote(seeds, ws.expert_prob, rng_seed)
                 for a, (seeds, rng_seed) in zip(self.env_actors, players, strict=False)]
        tables = [t for t, _ in calls]
        n_rows = sum(m["rows"] for m in await asyncio.gather(*(m for _, m in calls)))
        ds = await asyncio.to_thread(lambda: ray.data.from_arrow_refs(tables).materialize())
        shards = await asyncio.to_thread(split_for_workers, ds, self.cfg.trainer.num_workers)
        logger.info("warm start: %d demonstration steps from %d episodes", n_rows, ws.demo_seeds)
        bar = tqdm(total=ws.steps, desc="warm start (supervised)")
        done, first = 0, True
        while done < ws.steps and not self._stop:
            steps = min(ws.eval_every, ws.steps - done)
            async with self._update_lock:
                results = await self.trainer.run({"kind": "sft", "shards": shards if first else None,
                                                  "steps": steps, "batch_size": ws.batch_size, "lr": ws.lr,
                                                  "want_weights": self._via_object_store})
                await self._publish(results)
            first = False
            done += steps
            bar.update(steps)
            val = await self._validate(val_seeds, log=False)
            self._log({"iteration": 0, "phase": "warm_start", "warm_start/step": done,
                       **{f"warm_start/{k}": v for k, v in results[0]["metrics"].items()}, **val})
            logger.info("warm start step %d/%d: loss %.3f, held-out success %.1f%%", done, ws.steps,
                        results[0]["metrics"].get("sft_loss", float("nan")), 100 * val["val/success_rate"])
            if val["val/success_rate"] >= ws.target_success:
                break
            await self._answer_checkpoint_requests()
        bar.close()
        if self._stop:  # stopped during the warm start: the run's end checkpoints it; a resume warm-starts again
            return
        await self.trainer.run({"kind": "reset_optimizer"})
        # RL starts from here: this policy is the KL reference from now on, kept outside the rotating checkpoints
        # (with LoRA the reference stays the base model: the policy with its adapter off).
        if self.cfg.policy.lora is None:
            card = self.cfg.agent_card(iteration=0, weight_version=self.version, warm_start_done=True,
                                       base_model=self.cfg.policy.model)
            weights = await asyncio.to_thread((await self._stored_weights()).state_dict)
            self.reference_model = str(save_reference(self.run_dir, weights, self.template, card))
            await self.trainer.run({"kind": "set_reference"})
        self.warm_start_done = True
        await self._checkpoint()
        self.phase = "training"

    # ---- output ----------------------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        # NaN/inf (e.g. a mean over no rows) become null: JSON readers and the HTTP status must never choke on them.
        record = {"time": time.time(), **{k: (None if isinstance(v, float) and not np.isfinite(v) else v)
                                          for k, v in record.items()}}
        self.last_metrics = record
        self.sink.log(record)

    def _print_line(self, r: dict[str, Any]) -> None:
        val = f" | val success {100 * r['val/success_rate']:.1f}%" if "val/success_rate" in r else ""
        logger.info(
            "iter %d/%d | success %.1f%% | return %.2f | valid %.1f%% | steps/s %.0f | rollout %.1fs data %.1fs "
            "train %.1fs bcast %.2fs%s%s", r["iteration"], self.cfg.iterations, 100 * r.get("train/success_rate", 0),
            r.get("train/return", 0.0), 100 * r.get("train/valid_action_ratio", 0), r.get("perf/env_steps_per_s", 0),
            r.get("time/rollout_s", 0), r.get("time/dataset_s", 0), r.get("time/train_s", 0),
            r.get("time/broadcast_s", 0), val,
            f" | staleness max {r.get('train/staleness_max', 0)} overlap {100 * r.get('perf/overlap_share', 0):.0f}%"
            if self.cfg.rollout.mode == "async" else "")
