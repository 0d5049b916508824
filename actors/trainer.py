"""The one long-lived Ray Train job of a run, and the mailbox through which the controller feeds it.

`TrainerGroup.start()` launches a single `TorchTrainer` (FSDP2 or DDP over `num_workers` workers; gloo on CPU,
NCCL on GPU) whose workers loop: take the next task from the mailbox, train on their shard of that iteration's Ray
Dataset, hand the full new weights back (rank 0 puts them in the object store in buckets, actors/weights.py), and
wait again.
Paying the ~20 s Train start-up once per run, not once per iteration, is the point.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray

from actors.config import LoraConfig
from actors.lora import AdapterOff, adapter_items, add_adapter, decoder_layers
from actors.weights import WeightPacker, Weights, join_group, leave_group, send_weights

logger = logging.getLogger("raygent")


@ray.remote(num_cpus=0)
class TrainMailbox:
    """Tasks out to every worker rank, results back to the controller. Async: waiting costs nothing."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.tasks = [asyncio.Queue() for _ in range(world_size)]
        self.results: dict[int, dict[int, Any]] = {}
        self.arrived = asyncio.Condition()
        self.workers: dict[int, Any] = {}  # rank -> the worker actor's handle (to end a hung job)
        self.failure: str | None = None  # the first traceback a rank reported before its job ended
        self.doing: dict[int, tuple[float, str]] = {}  # rank -> (when, what it last said it was doing)

    def register(self, rank: int, worker: Any) -> None:
        self.workers[rank] = worker

    def progress(self, rank: int, doing: str) -> None:
        self.doing[rank] = (time.monotonic(), doing)

    def last_progress(self) -> dict[int, tuple[float, str]]:
        """rank -> (seconds since it last made progress, what it was doing)."""
        now = time.monotonic()
        return {rank: (now - t, doing) for rank, (t, doing) in sorted(self.doing.items())}

    def worker_handles(self) -> list[Any]:
        return list(self.workers.values())

    def report_failure(self, rank: int, traceback: str) -> None:
        self.failure = self.failure or f"rank {rank}: {traceback}"

    def get_failure(self) -> str | None:
        return self.failure

    def submit(self, task: dict[str, Any]) -> None:
        for queue in self.tasks:
            queue.put_nowait(task)

    async def next_task(self, rank: int) -> dict[str, Any]:
        return await self.tasks[rank].get()

    async def put_result(self, task_id: int, rank: int, result: Any) -> None:
        async with self.arrived:
            self.results.setdefault(task_id, {})[rank] = result
            self.arrived.notify_all()

    async def wait_results(self, task_id: int, timeout_s: float | None = None) -> list[Any] | None:
        """All ranks' results of `task_id` in rank order, or None on timeout (the caller checks the job is alive)."""
        async with self.arrived:
            try:
                await asyncio.wait_for(
                    self.arrived.wait_for(lambda: len(self.results.get(task_id, {})) == self.world_size), timeout_s)
            except asyncio.TimeoutError:
                return None
            done = self.results.pop(task_id)
        return [done[r] for r in range(self.world_size)]


def _load_model(path: str, device, strategy: str, mesh, cfg: dict[str, Any], trainable: bool):
    """An HF model on `device` in float32 (the master weights), with a fresh LoRA adapter when `cfg["lora"]` (only
    the adapter trains), sharded with FSDP2 per decoder layer and then at the root (the FSDP2 recipe), bf16 compute
    under `mixed_precision: bf16` (float32 gradient reduction)."""
    import torch
    from transformers import AutoModelForCausalLM

    from actors.storage import local_folder

    model = AutoModelForCausalLM.from_pretrained(local_folder(path), dtype=torch.float32).to(device)
    if trainable:
        model.train()
        if cfg.get("activation_checkpointing"):
            model.config.use_cache = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.get("lora"):
            model = add_adapter(model, LoraConfig.model_validate(cfg["lora"]))
    else:
        model.eval().requires_grad_(False)
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if cfg.get("mixed_precision") == "bf16" else MixedPrecisionPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    elif strategy == "ddp" and trainable:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    return model


def setup_models(cfg: dict[str, Any], world: int):
    """The policy (trainable) and, when `kl_coef > 0`, the frozen reference model sharded the same way (with LoRA:
    the policy with its adapter off); the device, the strategy in effect (one worker runs unsharded) and the
    autocast dtype (bf16 without FSDP2's policy)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if cfg["use_gpu"] else torch.device("cpu")
    strategy = cfg["strategy"] if world > 1 else "none"
    mesh = None
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
    model = _load_model(cfg["model_path"], device, strategy, mesh, cfg, trainable=True)
    ref = None
    if cfg["optim"].get("kl_coef", 0) > 0:
        ref = AdapterOff(getattr(model, "module", model)) if cfg.get("lora") else \
            _load_model(cfg["ref_model_path"], device, strategy, mesh, cfg, trainable=False)
    autocast_dtype = torch.bfloat16 if cfg.get("mixed_precision") == "bf16" and strategy != "fsdp" else None
    return model, ref, device, strategy, autocast_dtype


def copy_weights(source, target) -> None:
    """target's parameters := source's, in place; both sharded alike (FSDP2 shards, or whole tensors)."""
    import torch

    source = getattr(source, "module", source)  # DDP wraps the trainable model only
    with torch.no_grad():
        pairs = zip(source.named_parameters(), target.named_parameters(), strict=True)
        for (name, p), (ref_name, r) in pairs:
            if name != ref_name:
                raise RuntimeError(f"reference and policy differ: {name} vs {ref_name}")
            local = p.to_local() if hasattr(p, "to_local") else p
            (r.to_local() if hasattr(r, "to_local") else r).copy_(local)


def _weights_to_send(model, strategy: str, adapter_only: bool) -> list[tuple[str, Any]]:
    """What a sync sends, as this rank holds it: the full weights (a tied head included: engines that reload in
    place need it) or, with `adapter_only`, the LoRA adapter alone under peft's names; FSDP2 shards as DTensors."""
    module = model.module if strategy == "ddp" else model
    state = module.state_dict().items()
    return list(adapter_items(state) if adapter_only else state)


def _gathered(items: list[tuple[str, Any]]):
    """Each tensor whole, one at a time: under FSDP a gather per parameter (a collective every rank runs in the same
    order), so no rank ever holds the whole model at once."""
    for name, value in items:
        yield name, value.full_tensor() if hasattr(value, "full_tensor") else value


def pack_model_weights(model, strategy: str, dtype: str, bucket_bytes: int, rank: int,
                       put: Callable[[Any], Any] = ray.put, adapter_only: bool = False) -> Weights | None:
    """The weights to send (`_weights_to_send`) in `dtype` and in buckets, in the object store (rank 0 returns them;
    others None). Every rank calls this: no rank holds more than one gathered parameter beyond a bucket."""
    packer = WeightPacker(dtype, bucket_bytes, put, kind="adapter" if adapter_only else "full") if rank == 0 else None
    for name, full in _gathered(_weights_to_send(model, strategy, adapter_only)):
        if packer is not None:
            packer.add(name, full)
        del full
    return packer.finish() if packer is not None else None


def send_model_weights(model, strategy: str, dtype: str, bucket_bytes: int, rank: int, group: dict[str, Any],
                       version: int, adapter_only: bool = False) -> dict[str, Any]:
    """The weights to send over the weight group `group` (actors.weights.GroupSpec as a dict), rank 0 sending as its
    rank 0. Every rank calls this (the gathers are collectives). A failed transfer (a member gone past the group's
    timeout) is reported, not raised: rank 0 still runs the rest of the gathers so that no rank waits for it, the
    group is left, and the controller falls back to the object store."""
    items = _weights_to_send(model, strategy, adapter_only)
    gathered = _gathered(items)
    if rank != 0:
        for _ in gathered:
            pass
        return {}
    started = time.perf_counter()
    try:
        sent = send_weights(join_group(group, 0), gathered, [(n, tuple(v.shape)) for n, v in items], dtype,
                            bucket_bytes, "adapter" if adapter_only else "full", version)
    except Exception as e:  # a peer's failure (or a lost member): reported to the controller
        for _ in gathered:
            pass
        leave_group()
        return {"send_error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    return {"sent_bytes": sent["bytes"], "sent_buckets": sent["buckets"],
            "send_seconds": time.perf_counter() - started}


def save_train_state(model, optimizer, path: str) -> None:
    """The model's and the optimizer's state as they are trained, into the folder `path` with
    torch.distributed.checkpoint: each rank writes its own shards (nothing of Adam is gathered on one rank), and
    DCP's metadata lets a job of another size (or unsharded) load them. A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer.state:  # fresh moments (just after reset_optimizer) are saved as none: reading them would step
        state["optim"] = get_optimizer_state_dict(model, optimizer)  # once at lr 0 and skew Adam's bias correction
    dcp.save(state, checkpoint_id=path)


def stage_shards(path: str, rank: int, stage: str) -> None:
    """A rank on another node than the controller's wrote its shards (and rank 0 DCP's metadata) into `path` on
    its own disk: they go to the storage folder `stage`, where the controller collects them."""
    from actors.storage import Storage

    storage = Storage(stage)
    for f in Path(path).iterdir():
        if f.name.startswith(f"__{rank}_") or (rank == 0 and f.name == ".metadata"):
            storage.upload(f, f.name)
            f.unlink()


def load_train_state(model, optimizer, path: str) -> None:
    """`save_train_state`'s folder back into `model` and `optimizer`, resharded to this job's layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {"model": get_model_state_dict(model)}  # the shapes and shards to read into
    if any(key.startswith("optim.") for key in saved):
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if "optim" in state:
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optim"])


def _load_full_optimizer_state(model, optimizer, strategy: str, state) -> None:
    """A layout-2 checkpoint's `optimizer.pt` (one full, unsharded state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if strategy == "fsdp":
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)


def _rows(shard) -> dict[str, list]:
    rows = shard.take_all()
    return {k: [r[k] for r in rows] for k in (rows[0] if rows else {})}


def worker_resources(trainer_cfg: Any, placement: Any = None) -> dict[str, float] | None:
    """What one Train worker asks of a node: its CPUs (or a GPU: Ray Train's default of one CPU and one GPU) and the
    placement's custom resources."""
    extra = placement.trainer if placement is not None else {}
    if trainer_cfg.use_gpu:
        return {"CPU": 1.0, "GPU": 1.0, **extra} if extra else None
    return {"CPU": trainer_cfg.cpus_per_worker, **extra}


class Progress:
    """What this rank is doing, told to the mailbox when it changes and at most once a second while it goes on
    (fire and forget): the controller's stall deadline (`trainer.stall_timeout_s`) reads it."""

    def __init__(self, mailbox: Any, rank: int):
        self.mailbox, self.rank, self.doing, self.sent = mailbox, rank, "starting", 0.0

    def __call__(self, doing: str | None = None) -> None:
        now = time.monotonic()
        if doing is not None and doing != self.doing:
            self.doing, self.sent = doing, 0.0
        if now - self.sent >= 1.0:
            self.mailbox.progress.remote(self.rank, self.doing)
            self.sent = now


# A Train job's placement group is Ray Train's to remove; where the controller that owns the job dies with it, and
# the cluster runs no dashboard for Ray Train's cleaner to ask, it would hold its resources for good. Rank 0 records
# it in the GCS under the job's name, and the run's next Train job (or this one's end) removes what is recorded.
PG_KEY_PREFIX = "raygent-train-pg:"


def record_placement_group(job_key: str, pg_id: str | None) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    if pg_id:
        _internal_kv_put(f"{PG_KEY_PREFIX}{job_key}", pg_id, namespace="raygent")


def remove_placement_groups(job_key_prefix: str) -> int:
    """Remove the recorded placement groups of the Train jobs whose keys (`<run name>/<job id>`) start with
    `job_key_prefix` (their records too): how many were still holding resources."""
    from ray._raylet import PlacementGroupID
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    removed = 0
    for key in _internal_kv_list(f"{PG_KEY_PREFIX}{job_key_prefix}", namespace="raygent"):
        pg_id = _internal_kv_get(key, namespace="raygent")
        if pg_id:
            pg = PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id.decode())))
            if placement_group_table(pg).get("state") not in (None, "REMOVED"):
                remove_placement_group(pg)
                removed += 1
        _internal_kv_del(key, namespace="raygent")
    return removed


def train_loop_per_worker(cfg: dict[str, Any]) -> None:
    """Runs on every Train worker for the whole run: take the next task from the mailbox, run it (the update itself
    is `actors.learner`), hand the result back."""
    import ray.train
    import torch

    from actors.config import OptimConfig
    from actors.learner import Collective, fresh_rows, lr_at, rl_step, sft_step
    from actors.metrics import quiet_frameworks

    quiet_frameworks(cfg.get("framework_log_level", "WARNING"))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(cfg["seed"])
    torch.set_num_threads(max(1, int(cfg.get("threads", 1))))
    mailbox = ray.get_actor(cfg["mailbox"], namespace=cfg["namespace"])
    ray.get(mailbox.register.remote(rank, ray.get_runtime_context().current_actor))
    progress = Progress(mailbox, rank)
    if rank == 0:
        record_placement_group(cfg["job_key"], ray.get_runtime_context().get_placement_group_id())
    progress("loading the model")
    model, ref_model, device, strategy, autocast_dtype = setup_models(cfg, world)
    collective = Collective.from_torch()
    collective.on_progress = progress  # every reduction across the ranks is a step forward
    optim = OptimConfig.model_validate(cfg["optim"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=optim.lr,
                                  betas=optim.betas, weight_decay=optim.weight_decay)  # LoRA: the adapter only
    if cfg.get("train_state"):
        from actors.storage import local_folder

        load_train_state(model, optimizer, local_folder(cfg["train_state"]))
    elif cfg.get("optimizer_state"):
        _load_full_optimizer_state(model, optimizer, strategy,
                                   torch.load(cfg["optimizer_state"], weights_only=False))
    pad_id = cfg["pad_id"]
    rng = np.random.default_rng(cfg["seed"] + rank)
    sft_data = None

    def run_task(task: dict[str, Any]) -> dict[str, Any]:
        nonlocal sft_data
        kind = task["kind"]
        result: dict[str, Any] = {}
        if kind == "rl":
            t0 = time.perf_counter()
            progress("reading its shard of the iteration's rows")
            rows = _rows(task["shards"][rank])
            progress("updating")
            read_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            # Every row's lag behind the weights trained here, checked where the rows are consumed: rows past
            # max_staleness are left out of the loss (counted in the histogram's last bin, summed over ranks).
            rows, hist = fresh_rows(rows, task["version"], task["max_staleness"])
            hist = np.asarray(collective.sum(hist.tolist()))
            if hist[:-1].sum() > 0:
                metrics = rl_step(model, optimizer, rows, optim,
                                  lr=lr_at(optim, task["iteration"], cfg["iterations"]),
                                  norm_length=cfg["norm_length"], pad_id=pad_id, device=device, rng=rng,
                                  collective=collective, ref_model=ref_model, autocast_dtype=autocast_dtype)
            else:  # every row too stale (e.g. replicas that missed updates): no update, the weights stay
                metrics = {"rows": 0}
            metrics.update(read_seconds=read_seconds, update_seconds=time.perf_counter() - t0,
                           staleness_hist=[int(h) for h in hist[:-1]], too_stale_rows=int(hist[-1]),
                           staleness_max=int(np.flatnonzero(hist[:-1])[-1]) if hist[:-1].any() else 0)
        elif kind == "sft":
            if task.get("shards") is not None:
                progress("reading its shard of the demonstrations")
                sft_data = _rows(task["shards"][rank])
            progress("training on demonstrations")
            n = len(sft_data["prompt_ids"]) if sft_data else 0
            losses = []
            for _ in range(task["steps"]):
                # each rank draws its share of the batch from its own shard; the loss is the mean over all of them
                rows = rng.choice(n, size=min(max(1, task["batch_size"] // world), n), replace=False)
                losses.append(sft_step(model, optimizer, sft_data["prompt_ids"], sft_data["response_ids"], rows,
                                       lr=task["lr"], micro_batch_size=optim.micro_batch_size,
                                       grad_clip=optim.grad_clip, pad_id=pad_id, device=device,
                                       collective=collective, autocast_dtype=autocast_dtype,
                                       loss_masks=sft_data.get("loss_mask"))["sft_loss"])
            metrics = {"sft_loss": float(np.mean(losses))}
        elif kind == "send_weights":  # the collective path: this version's weights to the replicas' group
            metrics = send_model_weights(model, strategy, cfg["weights_dtype"], cfg["weights_bucket_bytes"], rank,
                                         task["group"], task["version"], adapter_only=bool(cfg.get("lora")))
        elif kind == "pack_weights":  # the weights in the object store (want_weights): checkpoints, new replicas
            metrics = {}
        elif kind == "reset_optimizer":
            # A new stage (RL after the supervised warm start) starts with fresh Adam moments: the warm start's
            # large-gradient second moments would otherwise shrink RL's first updates by an order of magnitude.
            optimizer.state.clear()
            metrics = {}
        elif kind == "set_reference":
            # After the warm start: the reference becomes the policy RL starts from (shard by shard, no reload).
            # With LoRA the reference stays the base model (the adapter switched off).
            if ref_model is not None and not cfg.get("lora"):
                copy_weights(model, ref_model)
            metrics = {}
        elif kind == "save_train_state":
            from torch.distributed.checkpoint.api import CheckpointException

            metrics = {}
            progress("saving its state")
            try:
                save_train_state(model, optimizer, task["path"])
                if task.get("stage") and ray.get_runtime_context().get_node_id() != task["node"]:
                    stage_shards(task["path"], rank, task["stage"])
            except (OSError, CheckpointException) as e:
                # A full or read-only disk fails every rank alike (DCP gathers the writers' errors): each reports,
                # none raises, and the controller keeps the last checkpoint.
                result["write_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        else:
            raise ValueError(f"unknown trainer task {kind!r}")
        result["metrics"] = metrics  # already global (all-reduced inside the steps)
        if task.get("want_weights"):
            progress("packing the weights")
            weights = pack_model_weights(model, strategy, cfg["weights_dtype"], cfg["weights_bucket_bytes"], rank,
                                         adapter_only=bool(cfg.get("lora")))
            if weights is not None:
                result["weights"] = weights  # bucket refs: the bytes stay in the object store
        return result

    while True:
        progress("waiting for a task")
        task = ray.get(mailbox.next_task.remote(rank))
        kind = task["kind"]
        progress(f"running {kind!r}")
        if kind == "stop":
            ray.get(mailbox.put_result.remote(task["id"], rank, {"stopped": True}))
            break
        started = time.perf_counter()
        try:
            result = run_task(task)
        except Exception:
            # Reported, then raised: the job ends (Ray Train stops the other ranks, which would otherwise wait in a
            # collective forever) and the controller restarts it from the last checkpoint.
            import traceback

            ray.get(mailbox.report_failure.remote(rank, traceback.format_exc(limit=8)))
            raise
        result.setdefault("metrics", {})["seconds"] = time.perf_counter() - started
        ray.get(mailbox.put_result.remote(task["id"], rank, result))


class TrainerFailure(RuntimeError):
    """The Train job failed, hung past its deadline, or ended: the controller restarts it from the last
    checkpoint."""


# What the run waits for when it waits on each kind of Train task (failure messages name it).
TASK_PHASES = {"rl": "an update", "sft": "the warm start", "send_weights": "a weight broadcast",
               "pack_weights": "packing weights", "save_train_state": "a checkpoint",
               "reset_optimizer": "the end of the warm start", "set_reference": "the end of the warm start",
               "stop": "the Train job's stop"}


class TrainerGroup:
    """Controller-side handle on the run's single TorchTrainer: start once, then `await run(task)` per step."""

    def __init__(self, run_name: str, run_dir: str, trainer_cfg: Any, worker_cfg: dict[str, Any],
                 placement: Any = None):
        self.world = trainer_cfg.num_workers
        self.trainer_cfg, self.placement = trainer_cfg, placement
        self.namespace = ray.get_runtime_context().namespace
        self.job_id = uuid.uuid4().hex[:8]  # one per job: a restarted job gets its own mailbox and Train run
        self.mailbox_name = f"raygent-mailbox-{run_name}-{self.job_id}"
        self.job_key = f"{run_name}/{self.job_id}"  # run names have no "/"
        self.mailbox = TrainMailbox.options(name=self.mailbox_name, namespace=self.namespace).remote(self.world)
        self.worker_cfg = {**worker_cfg, "mailbox": self.mailbox_name, "job_key": self.job_key,
                           "namespace": self.namespace,
                           "use_gpu": trainer_cfg.use_gpu, "strategy": trainer_cfg.strategy}
        self.run_dir = run_dir
        self.error: BaseException | None = None
        self._next_id = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        if self.trainer_cfg.use_gpu:
            import torch

            if not torch.cuda.is_available() and not ray.cluster_resources().get("GPU"):
                raise RuntimeError("trainer.use_gpu is true but the cluster has no GPU; set trainer.use_gpu: false")
        trainer = TorchTrainer(
            train_loop_per_worker, train_loop_config=self.worker_cfg,
            scaling_config=ScalingConfig(num_workers=self.world, use_gpu=self.trainer_cfg.use_gpu,
                                         resources_per_worker=worker_resources(self.trainer_cfg, self.placement),
                                         placement_strategy=self.placement.trainer_strategy if self.placement
                                         else "PACK"),
            # a collective that waits longer than this raises on every rank (a hung or dead peer): the job ends
            torch_config=TorchConfig(backend="nccl" if self.trainer_cfg.use_gpu else "gloo",
                                     timeout_s=int(self.trainer_cfg.task_timeout_s)),
            run_config=RunConfig(name=f"trainer-{self.job_id}", storage_path=os.path.join(self.run_dir, "ray_train")),
        )

        def fit() -> None:
            try:
                trainer.fit()
            except BaseException as e:  # surfaced to the controller on its next wait
                self.error = e
                logger.error("the training job failed: %s", e)

        self._thread = threading.Thread(target=fit, name="raygent-train-fit", daemon=True)
        self._thread.start()

    async def run(self, task: dict[str, Any], poll_s: float = 5.0, timeout_s: float | None = None) -> list[Any]:
        """Send `task` to every rank and wait for all their results (rank order). Raises `TrainerFailure` when a
        rank fails, the job ends, the task outlives its deadline (`trainer.task_timeout_s`), or no rank makes
        progress for `trainer.stall_timeout_s` (a rank stopped, or blocked waiting for something that never
        comes); the job is then ended, so nothing of it is left waiting."""
        task = {**task, "id": self._next_id}
        self._next_id += 1
        submitted = time.monotonic()
        deadline = submitted + (timeout_s or self.trainer_cfg.task_timeout_s)
        self.mailbox.submit.remote(task)
        while True:
            try:
                results = await asyncio.wait_for(self.mailbox.wait_results.remote(task["id"], poll_s), poll_s + 30)
            except (asyncio.TimeoutError, ray.exceptions.RayActorError) as e:
                await self.kill()
                raise TrainerFailure(f"the training job's mailbox stopped answering ({type(e).__name__})") from e
            if results is not None:
                return results
            failure = await self.mailbox.get_failure.remote()
            if failure is not None or self.error is not None or (
                    self._thread is not None and not self._thread.is_alive()):
                await self.kill()
                raise TrainerFailure(f"trainer task {task['kind']!r} failed: {failure or repr(self.error)}")
            if time.monotonic() > deadline:
                await self.kill()
                raise TrainerFailure(f"trainer task {task['kind']!r} ({TASK_PHASES.get(task['kind'], '')}) did not "
                                     f"finish within {timeout_s or self.trainer_cfg.task_timeout_s:.0f}s")
            stalled = await self._stalled(submitted)
            if stalled is not None:
                await self.kill()
                raise TrainerFailure(f"the Train job made no progress for {self.trainer_cfg.stall_timeout_s:.0f}s "
                                     f"during {TASK_PHASES.get(task['kind'], task['kind'])} (task "
                                     f"{task['kind']!r}): {stalled}")

    async def _stalled(self, since: float) -> str | None:
        """What each rank was last doing, when no rank has made progress for trainer.stall_timeout_s (counted from
        `since` at the latest: a task's submission); None while the job moves or its workers are starting."""
        limit = self.trainer_cfg.stall_timeout_s
        if time.monotonic() - since < limit:
            return None
        ranks = await asyncio.wait_for(self.mailbox.last_progress.remote(), 30)
        if ranks and min(age for age, _ in ranks.values()) < limit:
            return None
        if not ranks:
            # Before any rank reports, its workers either wait for their placement group (a stall: say what it
            # waits for) or, the group placed, start their processes (importing torch takes a loaded node a minute
            # or more): only the task deadline bounds that.
            table = await asyncio.to_thread(ray.util.placement_group_table)
            if not any(pg["state"] in ("PENDING", "RESCHEDULING") for pg in table.values()):
                return None
            return ("no rank started: its workers wait for resources (a placement group of "
                    f"{self.world} x {worker_resources(self.trainer_cfg, self.placement)}; free: "
                    f"{ray.available_resources()})")
        return "; ".join(f"rank {r} was {doing} {age:.0f}s ago" for r, (age, doing) in ranks.items())

    async def kill(self) -> None:
        """End the job now: its workers (a hung collective never returns), then wait for `fit` to notice, and free
        its placement group."""
        try:
            workers = await asyncio.wait_for(self.mailbox.worker_handles.remote(), 10)
        except Exception:
            workers = []
        for worker in workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:
                pass
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 120)
        try:
            ray.kill(self.mailbox)
        except Exception:
            pass
        await asyncio.to_thread(remove_placement_groups, self.job_key)

    async def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            try:
                await self.run({"kind": "stop"}, timeout_s=120)
            except TrainerFailure:
                return
            await asyncio.to_thread(self._thread.join, 60)
        await asyncio.to_thread(remove_placement_groups, self.job_key)
