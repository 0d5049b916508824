"""The `raygent` command: list environments, play one in the terminal, run the supervised warm start, evaluate a
trained agent."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import envs
import memory


def _cmd_envs(args: argparse.Namespace) -> int:
    for name in envs.list_envs():
        env = envs.make(name)
        summary = " ".join(env.task_description.split())[:90]
        print(f"{name:14s} max_steps={env.max_steps:<3d} {summary}")
    return 0


def _cmd_play(args: argparse.Namespace) -> int:
    """A person plays the env through the episode runner and sees the exact prompt the agent would see (same
    template, same memory; with --model, the env, kwargs and memory of that model folder's agent card)."""
    from actors.episodes import play, run_sync, scripted_decider
    from app.eval import load_card

    if args.model:
        card = load_card(Path(args.model), args.env, None)
        env, mem, label = card.make_env(), card.make_memory(), f"{card.env.name} as {args.model} was trained"
    elif args.env:
        env, mem, label = envs.make(args.env), memory.make(args.memory), args.env
    else:
        raise ValueError("give an env name (raygent envs) or --model DIR")
    print(f"# {label}, seed {args.seed}. Type a reply (a bare action is wrapped in <action></action> for you); "
          "Ctrl-D quits.\n")
    total = 0.0

    def choose(turn) -> str | None:
        print("=" * 30 + " prompt " + "=" * 30)
        print(turn.prompt_text)
        print("=" * 68)
        try:
            line = input("your reply> ")
        except EOFError:
            print()
            return None
        # Replies that already carry an env's own tags go through as typed; a bare action is wrapped.
        tagged = re.search(r"<(action|search|answer|tool_call)>", line, re.IGNORECASE)
        return line if tagged else f"<action>{line.strip()}</action>"

    def after(record, observation: str, over: bool) -> None:
        nonlocal total
        total += record.reward
        valid = "valid" if record.valid else "INVALID"
        print(f"-> {valid} action {record.action!r}, reward {record.reward:+g}, return {total:+g}\n")

    async def one() -> Any:
        return await play(env, mem, scripted_decider(choose), seed=args.seed, on_step=after)

    episode = run_sync(one())
    if episode.ended in ("terminated", "truncated"):
        print(env.render())
        print(f"Episode over after {len(episode.steps)} steps: {'won' if episode.won else 'not won'}, "
              f"return {episode.return_:+g}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from app.launch import parse_overrides, train

    try:
        overrides = parse_overrides(args.set)
    except ValueError as e:
        print(f"raygent train: {e}")
        return 2
    return train(args.config, overrides=overrides)


def _cmd_eval(args: argparse.Namespace) -> int:
    from app.eval import evaluate_checkpoint, format_report

    env_kwargs = _json_arg(args.env_kwargs, "--env-kwargs")
    splits = None if args.split in (None, "all") else args.split.split(",")
    out = args.out or Path(args.checkpoint) / "eval.json"
    report = evaluate_checkpoint(args.checkpoint, splits=splits, n_seeds=args.seeds, samples=args.samples,
                                 temperature=args.temperature, engine=args.engine, env=args.env,
                                 env_kwargs=env_kwargs, max_steps=args.max_steps, out=out)
    print(format_report(report))
    print(f"wrote {out}")
    return 0


def _json_arg(value: str | None, flag: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not JSON: {e}") from None


# `raygent sft` flags that override a field of the training config (dotted path), so that a bad value names the
# field exactly as a bad config file does.
SFT_OVERRIDES = {
    "model": "policy.model", "memory": "memory.name", "seed": "seed", "max_steps": "max_steps",
    "demo_seeds": "warm_start.demo_seeds", "expert_prob": "warm_start.expert_prob", "steps": "warm_start.steps",
    "batch_size": "warm_start.batch_size", "lr": "warm_start.lr", "eval_every": "warm_start.eval_every",
    "target_success": "warm_start.target_success", "val_envs": "validation.n_envs",
    "micro_batch_size": "optim.micro_batch_size",
}


def _cmd_sft(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from app.sft import build_config, train_sft

    hf_logging.disable_progress_bar()  # one line per evaluation is the display
    overrides = {path: getattr(args, dest) for dest, path in SFT_OVERRIDES.items()}
    if args.env_kwargs is not None:
        overrides["env.kwargs"] = _json_arg(args.env_kwargs, "--env-kwargs")
    cfg = build_config(args.config, args.env, overrides)
    train_sft(cfg, out=args.out, device=args.device)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raygent", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("envs", help="list the built-in environments").set_defaults(func=_cmd_envs)
    tr = sub.add_parser("train", help="serve run a training config, follow it to its end (what make train runs)",
                        description="Runs `serve run CONFIG` (framework logs to <run folder>/serve.log), prints one "
                                    "line per phase, evaluation and iteration, and exits when the run ends (0 done "
                                    "or stopped, 1 failed, 2 bad config), saying where the checkpoint is and how "
                                    "to serve it. Ctrl-C: stop after the running iteration, with a checkpoint.")
    tr.add_argument("config", nargs="?", default="serve_configs/train.yaml")
    tr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change one field of the training app's args (a dotted key, the value as YAML), e.g. "
                         "--set checkpoint.storage=s3://bucket/runs --set 'placement.trainer={gpu_node: 1}', or "
                         "of one of its deployments: --set deployments.Policy.ray_actor_options.num_gpus=0; the "
                         "config that runs is written to the run folder")
    tr.set_defaults(func=_cmd_train)
    play = sub.add_parser("play", help="play an environment in the terminal, shown the agent's prompt")
    play.add_argument("env", nargs="?", help="built-in env name or package.module:Class")
    play.add_argument("--model", help="a model folder (checkpoint, raygent sft output): play its agent card's env")
    play.add_argument("--seed", type=int, default=0)
    play.add_argument("--memory", default="simple", help=f"memory module: {sorted(memory.MEMORIES)} or import path")
    play.set_defaults(func=_cmd_play)

    ev = sub.add_parser(
        "eval", help="evaluate a trained agent on its env's held-out splits; writes a JSON report",
        description="Plays the held-out seeds of the model folder's agent card (the env, memory, prompt and "
                    "sampling it was trained with) in this process, as training's validation does: per split the "
                    "success rate, return, valid actions, pass@k over --samples, per-task numbers (ALFWorld) and "
                    "the score (WebShop), and every episode with its seeds.")
    ev.add_argument("--checkpoint", required=True, help="a model folder: runs/<run>/checkpoints/iter_N/model, a "
                                                        "raygent sft output, or any HF folder with --env")
    ev.add_argument("--split", help="held-out split(s) of the env, comma-separated, or all (default)")
    ev.add_argument("--seeds", type=int, default=64, help="held-out seeds (the run's own validation seeds)")
    ev.add_argument("--samples", type=int, default=1, help="episodes per seed (pass@k for k up to this)")
    ev.add_argument("--temperature", type=float, help="default: the card's validation temperature")
    ev.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    ev.add_argument("--env", help="the env of a folder without an agent card")
    ev.add_argument("--env-kwargs", help="env kwargs on top of the card's, as JSON")
    ev.add_argument("--max-steps", type=int, help="episode step limit (default: the env's)")
    ev.add_argument("--out", help="report path (default: <checkpoint>/eval.json)")
    ev.set_defaults(func=_cmd_eval)

    sft = sub.add_parser(
        "sft", help="supervised warm start on the env's expert (planner) actions; writes an HF model folder",
        description="Supervised fine-tuning on expert demonstrations, in this process (no Ray): the training app's "
                    "warm start on its own. Reads policy.model, env, memory, seed and warm_start from a training "
                    "config (or takes ENV and flags), prints one line per evaluation (step, loss, held-out "
                    "success) and writes an HF folder usable as policy.model of a training run.")
    sft.add_argument("env", nargs="?", help="env name or package.module:Class (instead of --config)")
    sft.add_argument("--config", help="training config: a Serve config such as serve_configs/train.yaml, or its args")
    sft.add_argument("--out", help="model folder to write (default: <output_dir>/sft-<env>); replaced atomically")
    sft.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    sft.add_argument("--model", help='policy.model: "default", "default:tiny", an HF folder or a hub id')
    sft.add_argument("--env-kwargs", help='env.kwargs as JSON, e.g. \'{"show_positions": true}\'')
    sft.add_argument("--memory", help=f"memory.name: {sorted(memory.MEMORIES)} or import path")
    sft.add_argument("--max-steps", type=int, help="episode step limit (default: the env's)")
    sft.add_argument("--seed", type=int)
    sft.add_argument("--steps", type=int, help="warm_start.steps: optimizer steps at most")
    sft.add_argument("--batch-size", type=int, help="warm_start.batch_size")
    sft.add_argument("--micro-batch-size", type=int, help="optim.micro_batch_size: rows per forward/backward")
    sft.add_argument("--lr", type=float, help="warm_start.lr")
    sft.add_argument("--eval-every", type=int, help="warm_start.eval_every")
    sft.add_argument("--target-success", type=float, help="warm_start.target_success: stop once reached")
    sft.add_argument("--demo-seeds", type=int, help="warm_start.demo_seeds: episodes that become demonstrations")
    sft.add_argument("--expert-prob", type=float, help="warm_start.expert_prob")
    sft.add_argument("--val-envs", type=int, help="validation.n_envs: held-out seeds per evaluation")
    sft.set_defaults(func=_cmd_sft)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad names and arguments: one clear line, not a traceback
        print(f"raygent: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
