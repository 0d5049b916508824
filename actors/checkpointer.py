"""When and where a run's checkpoints go (what a checkpoint holds is `actors.checkpoint`, its one layout).

The controller builds one `Checkpointer` per run. It writes a checkpoint of the weights the replicas hold (packed
by the Train job when the object store has no copy), the Train job's sharded state and the run state; keeps the
newest `checkpoint.keep` and every pinned one (the checkpoint the run resumed from, and the one its processes
load their starting model from: a restart reads it again); copies each to `checkpoint.storage` with the metrics;
answers `/checkpoint` requests at the end of the running iteration. A disk or storage that refuses a write is
logged and counted, and the run goes on with the last good checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from actors.checkpoint import (
    adapter_of,
    base_model_weights,
    latest_checkpoint,
    load_model_weights,
    mirror_checkpoint,
    save_checkpoint,
    write_model_template,
)
from actors.config import TrainConfig
from actors.lora import merge, read_adapter
from actors.storage import Storage, local_folder
from actors.trainer import TrainerGroup
from actors.weight_sync import WeightSync
from actors.weights import Weights, pack_weights

logger = logging.getLogger("raygent")


class Checkpointer:
    """The checkpoints of one run in `run_dir` (and `storage`), starting from `model_path`."""

    def __init__(self, cfg: TrainConfig, config_dict: dict[str, Any], run_dir: Path, model_path: str,
                 storage: Storage | None, resume_from: Path | None, weights: WeightSync,
                 trainer: Callable[[], TrainerGroup]):
        self.cfg, self.config_dict, self.run_dir, self.model_path = cfg, config_dict, run_dir, model_path
        self.storage, self.resume_from, self.weights, self._trainer = storage, resume_from, weights, trainer
        self.last: str | None = str(resume_from) if resume_from else None
        self.version = -1  # the weight version of the last checkpoint
        self.failures = 0
        self.storage_failures = 0
        self._waiters: list[asyncio.Future] = []
        self._base_weights: dict[str, Any] | None = None  # a LoRA run's base model, for merged checkpoints
        self.local_model = ""
        self.template = run_dir / "model_template"

    async def prepare(self) -> None:
        """The starting model on this node (a storage URI is fetched into its cache) and the model folder template
        (config, tokenizer) every checkpoint's weights are saved into. Blocking file work off the event loop."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.local_model = await asyncio.to_thread(local_folder, self.model_path)
        self.template = await asyncio.to_thread(write_model_template, self.local_model, self.template)

    def due(self, iteration: int, stopping: bool) -> bool:
        """Whether the iteration just finished gets a checkpoint: every `checkpoint.every`, the last, and a stop's."""
        every = self.cfg.checkpoint.every
        return iteration == self.cfg.iterations or stopping or bool(every and iteration % every == 0)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.run_dir)

    # ---- writing ---------------------------------------------------------------------------------------------
    async def write(self, state: dict[str, Any]) -> Path | None:
        """A checkpoint of the current weights, the Train job's state and the run `state` (iteration,
        warm_start_done, reference_model); a disk that refuses it (full, read-only) is logged and counted, the
        previous checkpoint stays intact, and the run goes on: the last checkpoint's path (None before any)."""
        try:
            path = await self._write(state)
            if self.storage is not None:
                await self.to_storage(path.name, mirror_checkpoint, self.run_dir, path, self.storage)
            return path
        except OSError as e:
            self.failures += 1
            logger.error("checkpoint of iteration %d failed (%s); the last one stays %s", state["iteration"], e,
                         self.last)
            return Path(self.last) if self.last else None

    async def _write(self, state: dict[str, Any]) -> Path:
        lora = self.cfg.policy.lora
        stored = await self.weights.stored()
        tensors = await asyncio.to_thread(stored.state_dict)
        weights = await asyncio.to_thread(self._full_weights, stored, tensors)
        adapter = tensors if lora is not None else None
        version = self.weights.version
        run_state = {"iteration": state["iteration"], "weight_version": version, "seed": self.cfg.seed,
                     "warm_start_done": state["warm_start_done"], "run_name": self.cfg.run_name, "time": time.time(),
                     "reference_model": state["reference_model"], "config": self.config_dict,
                     **({"base_model": self.model_path} if lora is not None else {})}

        async def save_train_state(path: str) -> None:
            # Ranks on other nodes write their shards on their own disks, then into `stage` in storage; they are
            # collected into this node's checkpoint here.
            stage = f"staging/{Path(path).parent.name}"
            results = await self._trainer().run({
                "kind": "save_train_state", "path": path, **({
                    "node": ray.get_runtime_context().get_node_id(), "stage": self.storage.uri_of(stage)}
                    if self.storage is not None else {})})
            if results[0].get("write_error"):
                raise OSError(results[0]["write_error"])
            if self.storage is not None and await asyncio.to_thread(self.storage.exists, stage):
                await asyncio.to_thread(self.storage.download_into, stage, path)
                await asyncio.to_thread(self.storage.delete, stage)
            if not (Path(path) / ".metadata").is_file():
                raise OSError(f"the Train job's state is not all in {path}: a rank on another node wrote it there "
                              "on its own disk; set checkpoint.storage so its shards reach this node")

        card = self.cfg.agent_card(iteration=state["iteration"], weight_version=version,
                                   warm_start_done=state["warm_start_done"], base_model=self.cfg.policy.model)
        path = await save_checkpoint(self.run_dir, state["iteration"], weights, self.template, run_state,
                                     self.cfg.checkpoint.keep, save_train_state, card, self.pinned(), adapter, lora)
        self.last = str(path)
        self.version = version
        return path

    def pinned(self) -> set[Path]:
        """Checkpoints rotation must keep while this run lives: the one it resumed from, and the one the policy
        replicas and env-group actors load their starting model from (a restart reads it again)."""
        pinned = {self.resume_from} if self.resume_from else set()
        start = Path(self.model_path.partition("?")[0])  # a local folder, or its copy in storage
        if start.name == "model" and start.parent.parent.name == "checkpoints":
            pinned.add(self.run_dir / "checkpoints" / start.parent.name)
        return pinned

    async def to_storage(self, what: str, copy: Callable[..., None], *args: Any) -> None:
        """A copy to `checkpoint.storage` (a checkpoint, the metrics); storage that refuses it (unreachable, full) is
        logged and counted, the file stays in the run folder, and the run goes on."""
        try:
            await asyncio.to_thread(copy, *args)
        except OSError as e:
            self.storage_failures += 1
            logger.error("copying %s to %r failed (%s); it stays in %s", what, self.storage,
                         str(e).splitlines()[0][:300], self.run_dir)

    async def upload_metrics(self) -> None:
        """The metrics history to storage (after a checkpoint: the history there includes its iteration)."""
        if self.storage is not None:
            await self.to_storage("metrics.jsonl", self.storage.upload, self.run_dir / "metrics.jsonl",
                                  "metrics.jsonl")

    # ---- `/checkpoint` requests ------------------------------------------------------------------------------
    def request(self) -> asyncio.Future:
        """A checkpoint at the next `answer_requests` (the end of the running iteration or warm-start chunk): the
        future gets its path."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    async def answer_requests(self, write: Callable[[], Any]) -> None:
        """If a checkpoint was asked for, `write()` one and hand its path to every request."""
        if self._waiters:
            path = await write()
            self.release_requests(path)

    def release_requests(self, path: Any = None) -> None:
        """Every waiting request gets `path` (the run ended: its last checkpoint)."""
        for w in self._waiters:
            if not w.done():
                w.set_result(path if path is not None else self.last)
        self._waiters.clear()

    # ---- weights held outside the Train job ------------------------------------------------------------------
    def pack(self, checkpoint: Path) -> Weights:
        """A checkpoint's weights (a LoRA run's: its adapter), held by this process, packed as the Train job packs
        its own: what a restore puts on the replicas."""
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
