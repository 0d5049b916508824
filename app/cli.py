"""The `raygent` command: list environments, play one in the terminal, run the supervised warm start."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

import envs
import memory


def _cmd_envs(args: argparse.Namespace) -> int:
    for name in envs.list_envs():
        env = envs.make(name)
        summary = " ".join(env.task_description.split())[:90]
        print(f"{name:14s} max_steps={env.max_steps:<3d} {summary}")
    return 0


def _cmd_play(args: argparse.Namespace) -> int:
    """A person plays the env and sees the exact prompt the agent would see (same template, same memory)."""
    env = envs.make(args.env)
    mem = memory.make(args.memory)
    observation, info = env.reset(seed=args.seed)
    mem.reset()
    total, steps = 0.0, 0
    print(f"# {args.env}, seed {args.seed}, memory {args.memory!r}. Type a reply (a bare action is wrapped in "
          "<action></action> for you); Ctrl-D quits.\n")
    while True:
        print("=" * 30 + " prompt " + "=" * 30)
        print(env.build_prompt(observation, mem.render()))
        print("=" * 68)
        try:
            line = input("your reply> ")
        except EOFError:
            print()
            break
        # Replies that already carry an env's own tags go through as typed; a bare action is wrapped.
        tagged = re.search(r"<(action|search|answer|tool_call)>", line, re.IGNORECASE)
        reply = line if tagged else f"<action>{line.strip()}</action>"
        next_observation, reward, terminated, truncated, info = env.step(reply)
        mem.store(observation, info.get("action"), reward, info)
        observation = next_observation
        total += reward
        steps += 1
        valid = "valid" if info["is_action_valid"] else "INVALID"
        print(f"-> {valid} action {info.get('action')!r}, reward {reward:+g}, return {total:+g}\n")
        if terminated or truncated:
            print(env.render())
            print(f"Episode over after {steps} steps: {'won' if info['won'] else 'not won'}, return {total:+g}")
            break
    return 0


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
        try:
            overrides["env.kwargs"] = json.loads(args.env_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--env-kwargs is not JSON: {e}") from None
    cfg = build_config(args.config, args.env, overrides)
    train_sft(cfg, out=args.out, device=args.device)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raygent", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("envs", help="list the built-in environments").set_defaults(func=_cmd_envs)
    play = sub.add_parser("play", help="play an environment in the terminal, shown the agent's prompt")
    play.add_argument("env", help="built-in env name or package.module:Class")
    play.add_argument("--seed", type=int, default=0)
    play.add_argument("--memory", default="simple", help=f"memory module: {sorted(memory.MEMORIES)} or import path")
    play.set_defaults(func=_cmd_play)

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
