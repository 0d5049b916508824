"""The `raygent` command: list environments, play one in the terminal."""

from __future__ import annotations

import argparse
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raygent", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("envs", help="list the built-in environments").set_defaults(func=_cmd_envs)
    play = sub.add_parser("play", help="play an environment in the terminal, shown the agent's prompt")
    play.add_argument("env", help="built-in env name or package.module:Class")
    play.add_argument("--seed", type=int, default=0)
    play.add_argument("--memory", default="simple", help=f"memory module: {sorted(memory.MEMORIES)} or import path")
    play.set_defaults(func=_cmd_play)
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
