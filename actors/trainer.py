"""The one long-lived Ray Train job of a run, and the mailbox through which the controller feeds it.

`TrainerGroup.start()` launches a single `TorchTrainer` (FSDP2 or DDP over `num_workers` workers; gloo on CPU,
NCCL on GPU) whose workers loop: take the next task from the mailbox, train on their shard of that iteration's Ray
Dataset, hand the full new weights back (rank 0 puts them in the object store as numpy arrays), and wait again.
Paying the ~20 s Train start-up once per run, not once per iteration, is the point.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import ray

logger = logging.getLogger("raygent")


@ray.remote(num_cpus=0)
class TrainMailbox:
    """Tasks out to every worker rank, results back to the controller. Async: waiting costs nothing."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.tasks = [asyncio.Queue() for _ in range(world_size)]
        self.results: dict[int, dict[int, Any]] = {}
        self.arrived = asyncio.Condition()

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


def _setup_model(cfg: dict[str, Any], world: int):
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", torch.cuda.current_device()) if cfg["use_gpu"] else torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(cfg["model_path"], dtype=torch.float32).to(device)
    model.train()
    strategy = cfg["strategy"] if world > 1 else "none"
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        # Shard each decoder layer, then the root (embeddings, final norm, tied head): the FSDP2 recipe.
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    return model, device, strategy


def _full_state_dict(model, strategy: str) -> dict[str, np.ndarray]:
    """Full weights as float32 numpy arrays on rank 0 (empty elsewhere). Collective under FSDP: all ranks call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if strategy == "fsdp":
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = (model.module if strategy == "ddp" else model).state_dict()
    return {k: v.detach().float().cpu().numpy() for k, v in sd.items()}


def _optimizer_state(model, optimizer, strategy: str, full: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if strategy == "fsdp":
        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=full, cpu_offload=True))
    return optimizer.state_dict()


def _load_optimizer_state(model, optimizer, strategy: str, state) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if strategy == "fsdp":
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)


def _rows(shard) -> dict[str, list]:
    rows = shard.take_all()
    return {k: [r[k] for r in rows] for k in (rows[0] if rows else {})}


def train_loop_per_worker(cfg: dict[str, Any]) -> None:
    """Runs on every Train worker for the whole run."""
    import ray.train
    import torch
    import torch.distributed as dist

    from actors.learner import collate, mean_metrics, micro_batches, reply_values, rl_loss, sft_backward, token_logprobs
    from app.config import OptimConfig

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(cfg["seed"])
    torch.set_num_threads(max(1, int(cfg.get("threads", 1))))
    mailbox = ray.get_actor(cfg["mailbox"], namespace=cfg["namespace"])
    model, device, strategy = _setup_model(cfg, world)
    optim = OptimConfig.model_validate(cfg["optim"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas,
                                  weight_decay=optim.weight_decay)
    if cfg.get("optimizer_state"):
        _load_optimizer_state(model, optimizer, strategy, torch.load(cfg["optimizer_state"], weights_only=False))
    ref_model = None
    if optim.kl_coef > 0:
        from transformers import AutoModelForCausalLM

        ref_model = AutoModelForCausalLM.from_pretrained(cfg["ref_model_path"], dtype=torch.float32).to(device).eval()
    pad_id = cfg["pad_id"]
    rng = np.random.default_rng(cfg["seed"] + rank)

    def to_device(batch):
        return {k: v.to(device) for k, v in batch.items()}

    def optimizer_step() -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def run_rl(data: dict[str, list]) -> dict[str, float]:
        n = len(data["prompt_ids"])
        local_minibatch = max(1, optim.minibatch_size // world)
        advantages = torch.tensor(np.asarray(data["advantage"], dtype=np.float32))
        # Behaviour log-probs: recomputed with the training weights before any update (so the first ratio is
        # exactly 1), or the engine's own (then ratio also absorbs the engine/trainer mismatch).
        t0 = time.perf_counter()
        old_by_row = [torch.as_tensor(np.asarray(r, dtype=np.float32)) for r in data["rollout_logprobs"]]
        mismatch = []
        if optim.old_logprobs == "recompute":
            recomputed = []
            for sl in micro_batches(n, optim.micro_batch_size):
                batch = collate(data["prompt_ids"][sl], data["response_ids"][sl], pad_id, extra=old_by_row[sl])
                rollout, mask = batch.pop("extra"), batch["response_mask"]
                with torch.no_grad():
                    logp = token_logprobs(model, to_device(batch))[0].cpu()
                mismatch.append(float(((logp - rollout).abs() * mask).sum() / mask.sum().clamp(min=1)))
                recomputed += reply_values(logp, mask)
            old_by_row = recomputed
        old_logprob_seconds = time.perf_counter() - t0
        step_metrics, norms = [], []
        update_seconds = 0.0
        for _ in range(optim.epochs):
            order = rng.permutation(n)
            for mb_start in range(0, n, local_minibatch):
                mb = order[mb_start:mb_start + local_minibatch]
                for sl in micro_batches(len(mb), optim.micro_batch_size):
                    idx = mb[sl]
                    batch = collate([data["prompt_ids"][i] for i in idx], [data["response_ids"][i] for i in idx],
                                    pad_id, extra=[old_by_row[i] for i in idx])
                    batch["old_logprobs"] = batch.pop("extra")
                    batch["advantages"] = advantages[idx]
                    batch = to_device(batch)
                    ref = None
                    if ref_model is not None:
                        with torch.no_grad():
                            ref, _ = token_logprobs(ref_model, batch)
                    t0 = time.perf_counter()
                    loss, metrics = rl_loss(model, batch, optim, ref)
                    (loss * (len(idx) / len(mb))).backward()
                    update_seconds += time.perf_counter() - t0
                    step_metrics.append(metrics)
                t0 = time.perf_counter()
                norms.append(optimizer_step())
                update_seconds += time.perf_counter() - t0
        out = mean_metrics(step_metrics)
        # forward + backward + optimizer step of the update (the rest: data, old log-probs, collation)
        out.update(update_seconds=update_seconds, old_logprob_seconds=old_logprob_seconds,
                   grad_norm=float(np.mean(norms)), optimizer_steps=len(norms), rows=n,
                   rollout_trainer_logprob_gap=float(np.mean(mismatch)) if mismatch else 0.0)
        return out

    def run_sft(data: dict[str, list], steps: int, batch_size: int, lr: float) -> dict[str, float]:
        for group in optimizer.param_groups:
            group["lr"] = lr
        n = len(data["prompt_ids"])
        local = max(1, batch_size // world)
        metrics = []
        for _ in range(steps):
            idx = rng.choice(n, size=min(local, n), replace=False)
            metrics += sft_backward(model, data["prompt_ids"], data["response_ids"], idx, pad_id,
                                    optim.micro_batch_size, device)
            optimizer_step()
        for group in optimizer.param_groups:
            group["lr"] = optim.lr
        return mean_metrics(metrics)

    def all_reduce_mean(metrics: dict[str, float]) -> dict[str, float]:
        if world == 1:
            return metrics
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return {k: float(v) / world for k, v in zip(keys, t.tolist(), strict=True)}

    sft_data = None

    def run_task(task: dict[str, Any]) -> dict[str, Any]:
        nonlocal sft_data
        kind = task["kind"]
        result: dict[str, Any] = {}
        if kind == "rl":
            t0 = time.perf_counter()
            rows = _rows(task["shards"][rank])
            read_seconds = time.perf_counter() - t0
            metrics = {**run_rl(rows), "read_seconds": read_seconds}
        elif kind == "sft":
            if task.get("shards") is not None:
                sft_data = _rows(task["shards"][rank])
            metrics = run_sft(sft_data, task["steps"], task["batch_size"], task["lr"])
        elif kind == "reset_optimizer":
            # A new stage (RL after the supervised warm start) starts with fresh Adam moments: the warm start's
            # large-gradient second moments would otherwise shrink RL's first updates by an order of magnitude.
            optimizer.state.clear()
            metrics = {}
        elif kind == "save_optimizer":
            state = _optimizer_state(model, optimizer, strategy)
            if rank == 0:
                _atomic_torch_save(state, task["path"])
            metrics = {}
        else:
            raise ValueError(f"unknown trainer task {kind!r}")
        result["metrics"] = all_reduce_mean(metrics)
        if task.get("want_weights"):
            weights = _full_state_dict(model, strategy)
            if rank == 0:
                result["weights"] = [ray.put(weights)]  # in a list: the ref travels, the arrays stay put
        return result

    while True:
        task = ray.get(mailbox.next_task.remote(rank))
        kind = task["kind"]
        if kind == "stop":
            ray.get(mailbox.put_result.remote(task["id"], rank, {"stopped": True}))
            break
        started = time.perf_counter()
        try:
            result = run_task(task)
        except Exception:  # reported, not fatal: the controller decides (a failed collective would hang anyway)
            import traceback

            result = {"error": traceback.format_exc(limit=8)}
        result.setdefault("metrics", {})["seconds"] = time.perf_counter() - started
        ray.get(mailbox.put_result.remote(task["id"], rank, result))


def _atomic_torch_save(obj: Any, path: str) -> None:
    import torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.partial"
    torch.save(obj, partial)
    os.replace(partial, path)


class TrainerGroup:
    """Controller-side handle on the run's single TorchTrainer: start once, then `await run(task)` per step."""

    def __init__(self, run_name: str, run_dir: str, trainer_cfg: Any, worker_cfg: dict[str, Any]):
        self.world = trainer_cfg.num_workers
        self.trainer_cfg = trainer_cfg
        self.namespace = ray.get_runtime_context().namespace
        self.mailbox_name = f"raygent-mailbox-{run_name}-{os.getpid()}-{int(time.time())}"
        self.mailbox = TrainMailbox.options(name=self.mailbox_name, namespace=self.namespace).remote(self.world)
        self.worker_cfg = {**worker_cfg, "mailbox": self.mailbox_name, "namespace": self.namespace,
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
                                         resources_per_worker=None if self.trainer_cfg.use_gpu else
                                         {"CPU": self.trainer_cfg.cpus_per_worker}),
            torch_config=TorchConfig(backend="nccl" if self.trainer_cfg.use_gpu else "gloo"),
            run_config=RunConfig(name="trainer", storage_path=os.path.join(self.run_dir, "ray_train")),
        )

        def fit() -> None:
            try:
                trainer.fit()
            except BaseException as e:  # surfaced to the controller on its next wait
                self.error = e
                logger.error("the training job failed: %s", e)

        self._thread = threading.Thread(target=fit, name="raygent-train-fit", daemon=True)
        self._thread.start()

    async def run(self, task: dict[str, Any], poll_s: float = 5.0) -> list[Any]:
        """Send `task` to every rank and wait for all their results (rank order)."""
        task = {**task, "id": self._next_id}
        self._next_id += 1
        self.mailbox.submit.remote(task)
        while True:
            results = await self.mailbox.wait_results.remote(task["id"], poll_s)
            if results is not None:
                errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
                if errors:
                    raise RuntimeError(f"trainer task {task['kind']!r} failed on a worker:\n{errors[0]}")
                return results
            if self.error is not None or (self._thread is not None and not self._thread.is_alive()):
                raise RuntimeError(f"the training job stopped: {self.error!r}")

    async def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            await self.run({"kind": "stop"})
            await asyncio.to_thread(self._thread.join, 60)
