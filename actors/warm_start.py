"""The supervised warm start before RL (`warm_start:`): demonstrations of the env's expert, played by the env-group
actors, then chunks of `warm_start.eval_every` cross-entropy steps in the Train job, each followed by a held-out
validation, until `warm_start.steps` or `warm_start.target_success`. The policy it ends with is where RL starts: a
fresh optimizer, and (full fine-tuning) the KL reference, kept outside the rotating checkpoints."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import ray

from actors.batch import built_within, split_for_workers
from actors.checkpoint import save_reference
from actors.config import TrainConfig
from actors.demonstrations import demo_players
from actors.rollouts import EnvGroupPool
from actors.trainer import TrainerGroup
from actors.weight_sync import WeightSync

logger = logging.getLogger("raygent")


async def supervised_warm_start(cfg: TrainConfig, pool: EnvGroupPool, trainer: Callable[[], TrainerGroup],
                                weights: WeightSync, validate: Callable[[], Awaitable[dict[str, Any]]],
                                log: Callable[[dict[str, Any]], None], between_chunks: Callable[[], Awaitable[None]],
                                stopping: Callable[[], bool]) -> bool:
    """Train on demonstrations; each chunk's weights go to the replicas (`weights`), `validate()` scores them,
    `log` records the chunk, `between_chunks()` answers checkpoint requests. True when it ran to its end, False
    when the run was asked to stop (the run's end checkpoints it; a resume warm-starts again)."""
    from ray.experimental.tqdm_ray import tqdm

    ws = cfg.warm_start
    tables, n_rows = await pool.demonstrations(demo_players(cfg.seed, ws.demo_seeds, len(pool.actors)))
    shards = await built_within(cfg.trainer.stall_timeout_s, "the warm start's demonstration dataset",
                                lambda: split_for_workers(ray.data.from_arrow_refs(tables).materialize(),
                                                          cfg.trainer.num_workers))
    logger.info("warm start: %d demonstration steps from %d episodes", n_rows, ws.demo_seeds)
    bar = tqdm(total=ws.steps, desc="warm start (supervised)")
    done, first = 0, True
    while done < ws.steps and not stopping():
        steps = min(ws.eval_every, ws.steps - done)
        async with weights.update_lock:
            results = await trainer().run({"kind": "sft", "shards": shards if first else None, "steps": steps,
                                           "batch_size": ws.batch_size, "lr": ws.lr,
                                           "want_weights": weights.via_object_store})
            await weights.publish(results)
        first = False
        done += steps
        bar.update(steps)
        val = await validate()
        log({"iteration": 0, "phase": "warm_start", "warm_start/step": done,
             **{f"warm_start/{k}": v for k, v in results[0]["metrics"].items()}, **val})
        logger.info("warm start step %d/%d: loss %.3f, held-out success %.1f%%", done, ws.steps,
                    results[0]["metrics"].get("sft_loss", float("nan")), 100 * val["val/success_rate"])
        if val["val/success_rate"] >= ws.target_success:
            break
        await between_chunks()
    bar.close()
    return not stopping()


async def start_rl_here(cfg: TrainConfig, trainer: TrainerGroup, weights: WeightSync, run_dir: Path,
                        template: Path) -> str | None:
    """RL starts from the warm-started policy: fresh Adam moments (the warm start's large-gradient second moments
    would shrink RL's first updates by an order of magnitude) and, for full fine-tuning, this policy as the KL
    reference, saved outside the rotating checkpoints: its folder. With LoRA the reference stays the base model
    (the policy with its adapter off): None."""
    await trainer.run({"kind": "reset_optimizer"})
    if cfg.policy.lora is not None:
        return None
    card = cfg.agent_card(iteration=0, weight_version=weights.version, warm_start_done=True,
                          base_model=cfg.policy.model)
    tensors = await asyncio.to_thread((await weights.stored()).state_dict)
    reference = str(save_reference(run_dir, tensors, template, card))
    await trainer.run({"kind": "set_reference"})
    return reference
