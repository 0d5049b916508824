"""`raygent sft`: the supervised warm-start stage on its own, in one process (no Ray), on CPU or one GPU.

It reads the same training config as `serve run serve_configs/train.yaml` (policy.model, env, memory, seed, rollout
.max_tokens, validation.n_envs and the `warm_start:` section) and shares the training app's code: demonstrations from
`actors.demonstrations.make_demonstrations` (the env-group actors call it too), prompts from `actors.prompting`, the
loss and its micro-batched backward from `actors.learner`, and the held-out seeds of the controller's validation.
Every `eval_every` steps it plays the validation seeds (at `validation.temperature`) and prints one line; it stops after `steps` or once
held-out success reaches `target_success`, and writes an HF folder (safetensors, config, tokenizer with its chat
template, and `raygent_agent.json`: the env, memory, prompt and sampling it was trained for) atomically. That folder
works as `policy.model` of a training run (with `warm_start.enabled: false`), of the agent endpoint, and of
`raygent eval`.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import envs
import memory
from actors.config import TrainConfig, load_train_config

TRAIN_APP = "app.train:build_train_app"


# ---- configuration ---------------------------------------------------------------------------------------------
def read_config_file(path: str | Path) -> dict[str, Any]:
    """The training app's `args:` from a Serve config (the application whose import_path is app.train's), or the
    whole file when it is a bare args mapping."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: expected a mapping at the top, got {type(data).__name__}")
    if "applications" in data:
        apps = [a for a in data["applications"] or [] if isinstance(a, dict) and a.get("import_path") == TRAIN_APP]
        if not apps:
            raise ValueError(f"config {path}: no application with import_path {TRAIN_APP}")
        return dict(apps[0].get("args") or {})
    return data


def set_dotted(config: dict[str, Any], dotted: str, value: Any) -> None:
    """`config[a][b][c] = value` for `dotted` "a.b.c", creating (copies of) the parents."""
    *parents, leaf = dotted.split(".")
    node = config
    for key in parents:
        child = node.get(key)
        node[key] = child = dict(child) if isinstance(child, dict) else {}
        node = child
    node[leaf] = value


def build_config(config_path: str | None, env: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from a config file or an env name, with `overrides` ({dotted path: value}) applied
    first, so a bad flag value names its field like a bad file does."""
    if config_path and env:
        raise ValueError("give either ENV or --config, not both (the config names its env)")
    if not config_path and not env:
        raise ValueError("give an env name (raygent envs) or --config serve_configs/train.yaml")
    args = read_config_file(config_path) if config_path else {"env": {"name": env}}
    for dotted, value in overrides.items():
        if value is not None:
            set_dotted(args, dotted, value)
    return load_train_config(args)


def default_out_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.output_dir) / ("sft-" + re.sub(r"[^A-Za-z0-9._-]+", "_", cfg.env.name))


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                             f"torch.cuda.is_available() is False); use --device cpu")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown device {name!r}; allowed: auto, cpu, cuda")


def _check_out_dir(out: Path) -> None:
    """Refuse before training, not after: `out` is replaced only when it is a model folder (or empty)."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").exists())):
        raise ValueError(f"refusing to replace {out}: it exists and is not a model folder; pick another --out")


# ---- held-out evaluation ----------------------------------------------------------------------------------------
def evaluate(model: Any, tokenizer: Any, cfg: TrainConfig, seeds: Sequence[int], device: Any) -> dict[str, Any]:
    """The held-out seeds played as the training app validates them (`actors.evaluation.play_heldout`: the held-out
    split, `validation.samples` per seed, `validation.temperature`, the same sampling seeds), through the
    transformers engine the policy deployment falls back to, in this process."""
    from actors.episodes import Coalescer, run_sync
    from actors.evaluation import play_heldout, summarize
    from app.engines import HFEngine, in_process_send

    engine = HFEngine.from_model(model, tokenizer, device)
    coalescer = Coalescer(in_process_send(engine))
    val_kwargs = cfg.validation_env_kwargs
    sampling = {"temperature": cfg.validation.temperature, "top_p": cfg.rollout.top_p,
                "max_tokens": cfg.rollout.max_tokens}
    was_training = model.training
    model.eval()
    try:
        results = run_sync(play_heldout(
            lambda i: envs.make(cfg.env.name, **val_kwargs), lambda: memory.make(cfg.memory.name, **cfg.memory.kwargs),
            tokenizer, coalescer.generate, seeds, samples=cfg.validation.samples, sampling=sampling,
            max_model_len=cfg.policy.max_model_len, run_seed=cfg.seed, loop=cfg.agent_loop))
    finally:
        if was_training:
            model.train()
    report = summarize(results)
    report["won"] = sum(r["won"] for r in results)
    return report


# ---- output ----------------------------------------------------------------------------------------------------
def save_model_folder(model: Any, tokenizer: Any, out: Path, card: Any) -> Path:
    """An HF folder with its agent card, written into a temp folder beside `out`, then renamed into place (a previous
    model folder at `out` is replaced only once the new one is complete)."""
    from actors.checkpoint import write_agent_card

    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_out_dir(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old = None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is meant to be read by other users and tools
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_agent_card(tmp, card)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "prev")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


# ---- the stage -------------------------------------------------------------------------------------------------
def train_sft(cfg: TrainConfig, out: str | Path | None = None, device: str = "auto",
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the supervised stage of `cfg.warm_start` and write the model to `out`. Returns the summary (also saved
    as raygent_sft.json in the folder): the eval history, first and last loss, seconds per step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.demonstrations import demo_players, make_demonstrations
    from actors.learner import sft_step
    from app.default_model import resolve_model

    ws, optim = cfg.warm_start, cfg.optim
    out_dir = Path(out) if out else default_out_dir(cfg)
    _check_out_dir(out_dir.resolve())
    dev = resolve_device(device)
    model_path = resolve_model(cfg.policy.model)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(dev)
    model.train()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # The same demonstrations as the training app's warm start: its seeds, split over the env-group actors as the
    # controller splits them, actor k's player seeded cfg.seed + k.
    t0 = time.perf_counter()
    demos: dict[str, list[list[int]]] = {}
    for seeds, rng_seed in demo_players(cfg.seed, ws.demo_seeds, cfg.rollout.num_env_actors):
        part = make_demonstrations(tokenizer, cfg.env.name, cfg.env_kwargs, cfg.memory.name, cfg.memory.kwargs,
                                   seeds, ws.expert_prob, rng_seed, loop=cfg.agent_loop)
        for key, rows in part.items():
            demos.setdefault(key, []).extend(rows)
    prompts, responses = demos.get("prompt_ids", []), demos.get("response_ids", [])
    if not prompts:
        raise ValueError(f"env {cfg.env.name!r} gave no demonstrations (its expert_action() returned None at once)")
    demo_s = time.perf_counter() - t0
    val_seeds = envs.group_seeds(cfg.seed, 0, cfg.validation.n_envs, "val").tolist()
    log(f"sft: {cfg.env.name}, model {cfg.policy.model} on {dev}, {len(prompts)} demonstration steps from "
        f"{ws.demo_seeds} episodes ({demo_s:.1f}s), {len(val_seeds)} held-out seeds; up to {ws.steps} steps of batch "
        f"{ws.batch_size}, lr {ws.lr:g}, target success {ws.target_success:.0%}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    n = len(prompts)
    history: list[dict[str, Any]] = []
    first_loss: float | None = None
    done, train_s = 0, 0.0
    while done < ws.steps:
        chunk = min(ws.eval_every, ws.steps - done)
        metrics = []
        t0 = time.perf_counter()
        for _ in range(chunk):
            idx = rng.choice(n, size=min(ws.batch_size, n), replace=False)
            step = sft_step(model, optimizer, prompts, responses, idx, lr=ws.lr, micro_batch_size=optim.micro_batch_size,
                            grad_clip=optim.grad_clip, pad_id=pad_id, device=dev, loss_masks=demos.get("loss_mask"))
            if first_loss is None:
                first_loss = step["sft_loss"]
            metrics.append(step["sft_loss"])
        chunk_s = time.perf_counter() - t0
        train_s += chunk_s
        done += chunk
        t0 = time.perf_counter()
        val = evaluate(model, tokenizer, cfg, val_seeds, dev)
        eval_s = time.perf_counter() - t0
        record = {"step": done, "loss": float(np.mean(metrics)), **{f"val/{k}": v for k, v in val.items()},
                  "s_per_step": chunk_s / chunk, "eval_s": eval_s}
        history.append(record)
        log(f"step {done}/{ws.steps} | loss {record['loss']:.3f} | held-out success {100 * val['success_rate']:.1f}% "
            f"({val['won']}/{val['episodes']}) | valid {100 * val['valid_action_ratio']:.1f}% | "
            f"{record['s_per_step']:.3f} s/step | eval {eval_s:.1f}s")
        if val["success_rate"] >= ws.target_success:
            break

    summary = {"base_model": cfg.policy.model, "warm_start": ws.model_dump(), "steps": done,
               "demonstration_steps": n, "first_loss": first_loss, "last_loss": history[-1]["loss"],
               "final_success": history[-1]["val/success_rate"], "s_per_step": train_s / done,
               "demo_s": demo_s, "history": history}
    path = save_model_folder(model, tokenizer, out_dir, cfg.agent_card(sft=summary))
    summary["out"] = str(path)
    log(f"wrote {path} ({done} steps, held-out success {100 * summary['final_success']:.1f}%); use it as "
        f"policy.model of a training run with warm_start.enabled: false")
    return summary
