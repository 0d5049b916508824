"""The run's one Train job, supervised: started from the checkpoint the run resumes (or the starting model), and when
it fails, hangs past `trainer.task_timeout_s` or ends, started again from the last checkpoint (its model, optimizer
and KL reference), at most `trainer.max_restarts` times. The controller rolls the run back to that checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

from actors.checkpoint import in_storage, latest_checkpoint, train_state_of
from actors.config import TrainConfig
from actors.storage import Storage
from actors.trainer import TrainerFailure, TrainerGroup, remove_placement_groups

logger = logging.getLogger("raygent")


class TrainJobSupervisor:
    """`job` is the run's Train job of the moment; `restarts` counts the jobs that failed."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, storage: Storage | None, model_path: str, local_model: str):
        """`model_path`: the starting model as every node reads it; `local_model`: its copy on this node."""
        from transformers import AutoTokenizer

        self.cfg, self.run_dir, self.storage, self.model_path = cfg, run_dir, storage, model_path
        tokenizer = AutoTokenizer.from_pretrained(local_model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.job: TrainerGroup | None = None
        self.restarts = 0
        # a controller of this run that died took its Train job along, but not always the job's placement group
        left = remove_placement_groups(f"{cfg.run_name}/")
        if left:
            logger.warning("removed %d placement group(s) an earlier Train job of %s left holding resources", left,
                           cfg.run_name)

    def shared(self, folder: str) -> str:
        """A folder of the run folder as a process on another node reads it: through storage, when the run has it."""
        return in_storage(folder, self.run_dir, self.storage)

    def _start_model(self, checkpoint: Path | None) -> str:
        """The HF folder a job starts from: the checkpoint's model, or the starting one. A LoRA run's job always
        builds on the base model; its adapter (and the base) come back from the checkpoint's train_state."""
        if checkpoint is None or self.cfg.policy.lora is not None:
            return self.model_path
        return self.shared(str(checkpoint / "model"))

    def start(self, checkpoint: Path | None, reference_model: str) -> None:
        """A new job from `checkpoint` (None: the starting model, fresh optimizer), its KL reference
        `reference_model`. Blocking (Ray Train's start-up): run it in a thread."""
        cfg = self.cfg
        self.job = TrainerGroup(cfg.run_name, str(self.run_dir), cfg.trainer, {
            "model_path": self._start_model(checkpoint), "ref_model_path": self.shared(reference_model),
            "optim": cfg.optim.model_dump(),
            "seed": cfg.seed, "pad_id": self.pad_id, "norm_length": cfg.loss_norm_length, "iterations": cfg.iterations,
            "mixed_precision": cfg.trainer.mixed_precision, "weights_dtype": cfg.policy.dtype,
            "weights_bucket_bytes": cfg.weight_sync.bucket_bytes,
            "activation_checkpointing": cfg.trainer.activation_checkpointing, "threads": cfg.trainer.threads_per_worker,
            "lora": cfg.policy.lora.model_dump() if cfg.policy.lora else None,
            "framework_log_level": cfg.logging.framework_level,
            **{k: self.shared(v) for k, v in train_state_of(checkpoint).items()},
        }, cfg.placement)
        self.job.start()

    def restart_point(self, error: TrainerFailure) -> Path | None:
        """A failed job counted: the checkpoint its successor starts from (None: from the start). Past
        trainer.max_restarts the run fails."""
        self.restarts += 1
        if self.restarts > self.cfg.trainer.max_restarts:
            raise RuntimeError(f"the Train job failed {self.restarts} times (trainer.max_restarts "
                               f"{self.cfg.trainer.max_restarts}); last: {error}") from error
        checkpoint = latest_checkpoint(self.run_dir)
        logger.warning("the Train job failed (%s); restart %d/%d from %s", str(error).splitlines()[0][:300],
                       self.restarts, self.cfg.trainer.max_restarts, checkpoint or "the starting model")
        return checkpoint

    async def stop(self) -> None:
        if self.job is not None:
            await self.job.stop()

    async def kill(self) -> None:
        """End the job now (a failed run frees its workers)."""
        if self.job is not None:
            await self.job.kill()
