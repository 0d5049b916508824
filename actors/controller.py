"""The controller actor: runs a training run's iterations and answers status queries while it works.

One iteration, as a loop you can read top to bottom (`_iteration`):
  rollout (env-group actors x policy replicas; each group's block streams in with its advantages) -> Ray Dataset of
  step records -> the long-lived Train job (one shard per worker) -> new weights to every replica -> log.
In async mode (`rollout.mode: async`) the same loop starts each rollout `max_staleness` iterations before its
update (`_train`), so the env-group actors keep producing while the Train job updates.

The services it builds and drives, each in its own module:
  EnvGroupPool (actors/rollouts.py)         the env-group actors: rollouts, validation, demonstrations, revival
  WeightSync (actors/weight_sync.py)        the weight version and its transfers to the replicas
  TrainJobSupervisor (actors/supervisor.py) the Train job, and its restart from the last checkpoint
  Checkpointer (actors/checkpointer.py)     when and where checkpoints go, pinning, storage, /checkpoint
  supervised_warm_start (actors/warm_start.py)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

import envs
from actors.batch import built_within, training_batch
from actors.checkpoint import fetch_checkpoint, load_state, reference_model_of
from actors.checkpointer import Checkpointer
from actors.metrics import MetricsSink, console_logger, iteration_line, quiet_frameworks
from actors.rollouts import EnvGroupPool, rollout_metrics
from actors.supervisor import TrainJobSupervisor
from actors.trainer import TrainerFailure
from actors.warm_start import start_rl_here, supervised_warm_start
from actors.weight_sync import WeightSync
from algorithms import step_group_stats

logger = logging.getLogger("raygent")
HEARTBEAT_TIMEOUT_S = 120.0  # Serve health-checks the ingress every ~10 s


@ray.remote(num_cpus=0, max_restarts=0)
class Controller:
    def __init__(self, config: dict[str, Any], policy: Any, model_path: str, resume_from: str | None = None,
                 retriever: Any = None, config_hash: str = ""):
        from actors.config import TrainConfig

        self.cfg = TrainConfig.model_validate(config)
        console_logger()
        quiet_frameworks(self.cfg.logging.framework_level)
        # One console line per iteration is the run's progress display; Ray Data's own bars would bury it.
        ray.data.DataContext.get_current().enable_progress_bars = False
        self.config_dict = config
        self.policy, self.retriever, self.model_path = policy, retriever, model_path
        self.resume_from = Path(resume_from) if resume_from else None
        self.run_dir = self.cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.storage = self.cfg.checkpoint.run_storage(self.cfg.run_name)
        self.iteration = 0  # the next iteration to run
        self.phase = "starting"
        self.error: str | None = None
        self.last_metrics: dict[str, Any] = {}
        self.warm_start_done = False
        # The KL reference is the policy RL starts from: the starting model, replaced after a warm start; a resumed
        # run reads it from the checkpoint's state, never the resumed weights.
        self.reference_model = model_path
        self._stop = False
        self.drained_rollouts = 0
        self.started_at = time.time()
        self._config_hash = config_hash
        self.last_heartbeat = time.monotonic()
        self._task: asyncio.Task | None = None
        self.train_job: TrainJobSupervisor | None = None
        self.weights = WeightSync(self.cfg, policy, lambda: self.train_job.job)
        self.pool = EnvGroupPool(self.cfg, model_path, policy, retriever)
        self.checkpoints = self._checkpointer()

    def _checkpointer(self) -> Checkpointer:
        return Checkpointer(self.cfg, self.config_dict, self.run_dir, self.model_path, self.storage, self.resume_from,
                            self.weights, lambda: self.train_job.job)

    # ---- control surface (called by the training app's HTTP routes and the Policy replicas) --------------------
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
                "iterations": self.cfg.iterations, "weight_version": self.weights.version,
                "done": self.phase in ("done", "stopped", "failed"), "error": self.error,
                "last_checkpoint": self.checkpoints.last, "run_dir": str(self.run_dir),
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
            return {"checkpoint": self.checkpoints.last, "note": f"the run is {self.phase}: its last checkpoint"}
        if not self.weights.has_weights() and self.phase in ("starting", "baseline"):
            return {"checkpoint": self.checkpoints.last, "note": "no trained weights yet"}
        return {"checkpoint": str(await self.checkpoints.request())}

    async def latest_weights_for_replica(self) -> dict[str, Any] | None:
        """What a (re)starting Policy replica loads before it serves (actors/weight_sync.py)."""
        return await self.weights.for_new_replica()

    # ---- the run ---------------------------------------------------------------------------------------------
    async def _main(self) -> None:
        try:
            await self._run()
        except Exception as e:
            self.phase, self.error = "failed", f"{type(e).__name__}: {e}"
            logger.exception("the run failed")
        finally:
            self.checkpoints.release_requests()
            await self._release()

    async def _release(self) -> None:
        """A run that ended holds nothing: its env-group actors go, and a failed run's Train job with its placement
        group (a new run on this cluster starts clean). The controller stays, to answer for the run."""
        try:
            if self.phase == "failed" and self.train_job is not None:
                await self.train_job.kill()
            self.pool.stop()
        except Exception as e:  # the run's outcome stands whatever this finds
            logger.warning("releasing the run's actors: %s", e)

    async def _setup(self) -> None:
        cfg = self.cfg
        if self.resume_from is not None and not self.resume_from.exists() and self.storage is not None:
            # this controller runs on another node than the one that chose the checkpoint: its copy in storage
            self.resume_from = await asyncio.to_thread(fetch_checkpoint, self.run_dir, self.resume_from.name,
                                                       self.storage)
            self.checkpoints = self._checkpointer()
        resumed = None
        if self.resume_from is not None:
            resumed = load_state(self.resume_from)
            self.iteration, self.weights.version = resumed["iteration"], resumed["weight_version"]
            self.warm_start_done = resumed.get("warm_start_done", False)
            self.reference_model = reference_model_of(self.resume_from, resumed)
            logger.info("resuming %s from %s (next iteration %d; KL reference %s)", cfg.run_name, self.resume_from,
                        self.iteration, self.reference_model)
        # Blocking file and model work off the event loop: /status keeps answering while the run starts.
        self.sink = await asyncio.to_thread(MetricsSink, self.run_dir, cfg.run_name, cfg.logging, self.config_dict,
                                            self.iteration if resumed is not None else None)
        (self.run_dir / "config.json").write_text(json.dumps(self.config_dict, indent=2))
        await self.checkpoints.prepare()
        await self.weights.check_backend()  # before anything starts
        await self.pool.start()
        # The Train job starts from the checkpoint it resumes (the replicas' start model may be an older one: a
        # controller started again by the health check resumes from the latest checkpoint).
        self.train_job = await asyncio.to_thread(TrainJobSupervisor, cfg, self.run_dir, self.storage, self.model_path,
                                                 self.checkpoints.local_model)
        await asyncio.to_thread(self.train_job.start, self.resume_from, self.reference_model)
        await self.weights.wait_for_replicas()
        # The replicas start from `model_path` under the version it was saved with (the training app passes the
        # resumed weight version as policy.initial_version); replicas that outlived an earlier controller of
        # this run hold later weights: they get the checkpoint's again, under a version above theirs.
        self.checkpoints.version = self.weights.version
        if self.resume_from is not None:
            await self._restore_replicas(self.resume_from)

    async def _run(self) -> None:
        cfg = self.cfg
        await self._setup()
        self.phase = "baseline"
        val_seeds = envs.group_seeds(cfg.seed, 0, cfg.validation.n_envs, "val")
        if self.iteration == 0 and not self.warm_start_done:
            if cfg.agent is None:  # the env's random admissible action: no floor for a user's own agent
                random_success = await self.pool.random_policy_success(val_seeds)
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
        if self.weights.has_weights() and self.checkpoints.version != self.weights.version:
            await self._checkpoint()  # stopped before any RL iteration: what the warm start made is kept
        await self.checkpoints.answer_requests(self._checkpoint)
        await self.train_job.stop()
        self.phase = "stopped" if self._stop and self.iteration < cfg.iterations else "done"
        self.sink.close()
        last = self.checkpoints.last
        logger.info("run %s %s after %d iterations; checkpoint: %s. Serve it: serve run "
                    "app.agent:build_agent_app model=%s/model", cfg.run_name, self.phase, self.iteration, last, last)

    async def _warm_start(self, val_seeds: np.ndarray) -> None:
        self.phase = "warm_start"
        finished = await supervised_warm_start(
            self.cfg, self.pool, lambda: self.train_job.job, self.weights,
            validate=lambda: self._validate(val_seeds, log=False), log=self._log,
            between_chunks=lambda: self.checkpoints.answer_requests(self._checkpoint), stopping=lambda: self._stop)
        if not finished:  # stopped during the warm start: the run's end checkpoints it; a resume warm-starts again
            return
        reference = await start_rl_here(self.cfg, self.train_job.job, self.weights, self.run_dir,
                                        self.checkpoints.template)
        self.reference_model = reference or self.reference_model
        self.warm_start_done = True
        await self._checkpoint()
        self.phase = "training"

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
                await self.weights.sync_replicas()
                for r in range(it, min(it + ahead + 1, cfg.iterations)):
                    if r not in rollouts:
                        rollouts[r] = asyncio.get_running_loop().create_task(self._rollout(r))
                record = await self._iteration(it, rollouts.pop(it))
                self.iteration = it + 1
                last = self.iteration == cfg.iterations
                if cfg.validation.every and (last or self.iteration % cfg.validation.every == 0):
                    record.update(await self._validate(val_seeds, log=False))
                checkpointed = self.checkpoints.due(self.iteration, self._stop)
                if checkpointed:
                    t0 = time.perf_counter()
                    await self._checkpoint()
                    record["time/checkpoint_s"] = time.perf_counter() - t0
                await self.checkpoints.answer_requests(self._checkpoint)
                self._log(record)
                if checkpointed:  # the history in storage includes this iteration
                    await self.checkpoints.upload_metrics()
                logger.info("%s", iteration_line(record, cfg.iterations, cfg.rollout.mode == "async"))
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
    async def _rollout(self, it: int) -> tuple[list[Any], list[dict[str, Any]], tuple[float, float]]:
        # In sync mode every row must come from the weights of this moment (a replica on others is counted, and
        # its groups left out); in async mode versions move during the rollout and the trainer checks each row's.
        return await self.pool.rollout(it, self.weights.version if self.cfg.rollout.mode == "sync" else None)

    async def _iteration(self, it: int, rollout: asyncio.Task) -> dict[str, Any]:
        """Wait for iteration `it`'s rollout, build its batch, update, broadcast; in async mode the rollouts of
        later iterations run meanwhile, and the share of the update they overlap is logged."""
        cfg = self.cfg
        t_start = time.perf_counter()
        self.phase = "rollout"
        prepared, roll, (roll_start, roll_end) = await rollout
        t_rollout = time.perf_counter()
        self.phase = "learning"
        record: dict[str, Any] = {"iteration": it + 1, "phase": "train", **rollout_metrics(roll, "train"),
                                  **self._fault_counts()}
        if not prepared:
            logger.error("iteration %d: every env-group actor failed; nothing to train on", it)
            return record
        ds, summary, shards, checks = await built_within(cfg.trainer.stall_timeout_s, f"iteration {it + 1}'s batch",
                                                         training_batch, prepared, cfg.algorithm,
                                                         cfg.trainer.num_workers, cfg.rollout.group_size)
        if ds is None:
            logger.warning("iteration %d: %d rows after filtering; skipping the update", it, len(summary))
            return record
        t_data = time.perf_counter()
        # GiGPO's step groups are over steps, or over the turns of conversation rows
        turns = summary.explode("turn_anchors") if "turn_anchors" in summary else summary.assign(
            turn_anchors=summary["anchor"])
        stats = step_group_stats(turns["group_id"].to_numpy(), turns["turn_anchors"].to_numpy())
        record.update({"data/rows": len(summary), "data/step_group_share": stats["step_group_share"],
                       "data/step_group_mean_size": stats["step_group_mean_size"],
                       "data/advantage_abs_mean": float(np.abs(summary["advantage"]).mean()),
                       "data/advantage_std": float(summary["advantage"].std()), **checks})
        async with self.weights.update_lock:
            results = await self.train_job.job.run({"kind": "rl", "shards": shards, "iteration": it,
                                                    "want_weights": self.weights.via_object_store,
                                                    "version": self.weights.version,
                                                    "max_staleness": cfg.rollout.lookahead})
            t_train = time.perf_counter()
            record.update({f"train/{k}": v for k, v in results[0]["metrics"].items()})
            await self.weights.publish(results)
        t_end = time.perf_counter()
        record.update({"weight_version": self.weights.version, "time/rollout_s": roll_end - roll_start,
                       "time/rollout_wait_s": t_rollout - t_start, "time/dataset_s": t_data - t_rollout,
                       "time/train_s": t_train - t_data, "time/broadcast_s": t_end - t_train,
                       "time/iteration_s": t_end - t_start,
                       "perf/overlap_share": self.pool.overlap(t_data, t_train),
                       "perf/policy_replicas": self.weights.replicas,
                       "perf/replicas_updated": self.weights.replicas_updated,
                       "faults/weight_sync_fallbacks": self.weights.fallbacks,
                       "faults/drained_rollouts": self.drained_rollouts})
        return record

    async def _validate(self, val_seeds: np.ndarray, tag: str = "val", log: bool = True) -> dict[str, Any]:
        """The held-out evaluation, spread over the env-group actors; logged as its own record unless `log` is
        False (then it joins the caller's)."""
        prev, self.phase = self.phase, "validating"
        record = await self.pool.validate(val_seeds)
        self.phase = prev
        if log:
            self._log({"iteration": self.iteration, "phase": tag, **record})
            logger.info("validation (%s): success %.1f%%, return %.2f, valid actions %.1f%%", tag,
                        100 * record["val/success_rate"], record["val/return"], 100 * record["val/valid_action_ratio"])
        return record

    # ---- checkpoints and the Train job's restarts ------------------------------------------------------------
    async def _checkpoint(self) -> Path | None:
        prev, self.phase = self.phase, "checkpointing"
        try:
            return await self.checkpoints.write({"iteration": self.iteration, "warm_start_done": self.warm_start_done,
                                                 "reference_model": self.reference_model})
        finally:
            self.phase = prev

    async def _restore_replicas(self, checkpoint: Path, always: bool = False) -> None:
        """A checkpoint's weights (held here, not by a Train worker that may be gone) on every replica."""
        await self.weights.restore(lambda: self.checkpoints.pack(checkpoint), always)
        self.checkpoints.version = self.weights.version

    async def _recover_trainer(self, error: TrainerFailure) -> None:
        """The Train job failed or hung: start a new one from the last checkpoint (model and optimizer), roll the
        run back to that checkpoint's iteration (its metrics after it are cut, the iterations are redone) and put
        its weights (without a checkpoint: the starting ones, as the new job holds them) on every replica under a
        new, higher version. Under the update lock: until then no weights of the run have a version."""
        async with self.weights.update_lock:
            checkpoint = self.train_job.restart_point(error)
            self.phase = "recovering"
            if checkpoint is not None:
                state = load_state(checkpoint)
                self.iteration, self.warm_start_done = state["iteration"], state.get("warm_start_done", False)
            else:  # nothing checkpointed yet: from the start (the warm start, if any, runs again)
                self.iteration, self.warm_start_done = 0, False
            self.sink.truncate(self.iteration)
            await asyncio.to_thread(self.train_job.start, checkpoint, self.reference_model)
            if checkpoint is not None:  # the lost job owned the latest weights: the checkpoint's, owned here
                await self._restore_replicas(checkpoint, always=True)
            elif self.weights.has_weights():  # the replicas may hold the lost job's weights
                await self.weights.resend_from_trainer()
            self._log({"iteration": self.iteration, "phase": "fault",
                       "faults/trainer_restarts": self.train_job.restarts,
                       "faults/restored_from": str(checkpoint) if checkpoint else None})

    # ---- output ----------------------------------------------------------------------------------------------
    def _fault_counts(self) -> dict[str, int]:
        return {"faults/replica_sync_failures": self.weights.replica_failures,
                "faults/checkpoint_failures": self.checkpoints.failures,
                "faults/storage_failures": self.checkpoints.storage_failures}

    def _log(self, record: dict[str, Any]) -> None:
        # NaN/inf (e.g. a mean over no rows) become null: JSON readers and the HTTP status must never choke on them.
        record = {"time": time.time(), **{k: (None if isinstance(v, float) and not np.isfinite(v) else v)
                                          for k, v in record.items()}}
        self.last_metrics = record
        self.sink.log(record)
