"""`raygent eval --checkpoint DIR`: a trained agent on its env's held-out splits, in this process (no Ray), with the
evaluation training's validation runs (`actors.evaluation.play_heldout`): the same held-out seeds and sampling seeds,
the agent card's env, memory, prompt and sampling. Several samples per seed give pass@k; envs that report a task
type (ALFWorld) get per-task numbers, WebShop its score. Writes a JSON report.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import envs
from actors.checkpoint import read_agent_card
from actors.config import AgentCard, EnvConfig, MemoryConfig


def load_card(model_dir: Path, env: str | None, env_kwargs: dict[str, Any] | None) -> AgentCard:
    """The folder's agent card; a folder without one (a plain HF model) needs `--env`."""
    card = read_agent_card(model_dir)
    if card is None:
        if env is None:
            raise ValueError(f"{model_dir} has no agent card (raygent_agent.json): name the env with --env")
        card = AgentCard(env=EnvConfig(name=env, kwargs=env_kwargs or {}), memory=MemoryConfig(name="simple"))
    elif env is not None and env != card.env.name:
        raise ValueError(f"{model_dir} was trained on {card.env.name!r}, not {env!r}")
    elif env_kwargs:
        card = card.model_copy(update={"env": EnvConfig(name=card.env.name, kwargs={**card.env.kwargs,
                                                                                     **env_kwargs})})
    return card


def evaluate_checkpoint(model: str, *, splits: list[str] | None = None, n_seeds: int = 64, samples: int = 1,
                        temperature: float | None = None, engine: str = "auto", env: str | None = None,
                        env_kwargs: dict[str, Any] | None = None, max_steps: int | None = None,
                        max_model_len: int | None = None, out: str | Path | None = None,
                        progress: bool = True) -> dict[str, Any]:
    """Evaluate the model folder on `splits` (default: every held-out split of its env) and return the report
    (also written to `out`): per split the summary (success, return, valid actions, pass@k, per task) and every
    episode (seed, sample, sampling seed, won, return, steps, task type, score)."""
    from tqdm import tqdm

    from actors.episodes import Coalescer, run_sync
    from actors.evaluation import play_heldout, summarize
    from app.default_model import resolve_model
    from app.engines import in_process_send, make_engine

    model_dir = Path(resolve_model(model))
    card = load_card(model_dir, env, env_kwargs)
    available = envs.make(card.env.name, **card.env.kwargs).heldout_splits
    splits = splits or list(available)
    unknown = [s for s in splits if s not in available]
    if unknown:
        raise ValueError(f"split {unknown[0]!r} is not a held-out split of {card.env.name!r}; allowed: "
                         f"{sorted(available)}")
    sampling = {"temperature": card.sampling.temperature if temperature is None else temperature,
                "top_p": card.sampling.top_p, "max_tokens": card.sampling.max_tokens}
    context = max_model_len or card.max_model_len
    run_seed = int(card.source.get("seed", 0))
    seeds = envs.group_seeds(run_seed, 0, n_seeds, "val").tolist()  # the run's own validation seeds
    started = time.perf_counter()
    llm = make_engine(engine, str(model_dir), max_model_len=context)
    coalescer = Coalescer(in_process_send(llm))
    report: dict[str, Any] = {"model": str(model_dir), "env": card.env.name, "engine": llm.name,
                              "sampling": sampling, "samples_per_seed": samples, "seeds": len(seeds),
                              "run_seed": run_seed, "card_source": card.source, "splits": {}}
    for split in splits:
        bar = tqdm(total=len(seeds) * samples, desc=f"{card.env.name} {split}", disable=not progress,
                   unit="episode")
        results = run_sync(play_heldout(
            lambda i, split=split: card.make_env(**available[split]), card.make_memory, llm.tokenizer,
            coalescer.generate, seeds, samples=samples, sampling=sampling, max_model_len=context,
            run_seed=run_seed, max_steps=max_steps, on_episode=lambda *_, bar=bar: bar.update(1), loop=card.loop))
        bar.close()
        report["splits"][split] = {"summary": summarize(results), "episodes": results}
    report["seconds"] = time.perf_counter() - started
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, out)
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['env']} | {report['model']} | engine {report['engine']} | T={report['sampling']['temperature']}"
             f" | {report['seeds']} seeds x {report['samples_per_seed']} samples"]
    for split, part in report["splits"].items():
        s = part["summary"]
        passes = ", ".join(f"{k} {v:.1%}" for k, v in s.items() if k.startswith("pass@"))
        score = f" | score {s['score']:.1f}" if "score" in s else ""
        lines.append(f"  {split:13s} success {s['success_rate']:.1%} | return {s['return']:.3f} | valid actions "
                     f"{s['valid_action_ratio']:.1%} | episode length {s['episode_length']:.1f}{score} | {passes}")
        for task, t in s.get("per_task", {}).items():
            lines.append(f"    {task:28s} success {t['success_rate']:.1%} ({t['episodes']} episodes)")
    return "\n".join(lines)
