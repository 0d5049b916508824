"""The `raygent` console command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RAYGENT = str(Path(sys.executable).with_name("raygent"))


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([RAYGENT, *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_envs_lists_every_builtin():
    import envs

    out = run("envs")
    assert out.returncode == 0, out.stderr
    for name in envs.list_envs():
        assert name in out.stdout


def test_play_sokoban_shows_the_agent_prompt_and_plays_to_the_end():
    import envs
    import memory
    from actors.prompting import agent_messages

    env = envs.make("sokoban")
    observation, _ = env.reset(seed=3)
    expected_first_prompt = agent_messages(env, observation, memory.make("simple").render())[0]["content"]
    moves = envs.sokoban.solve(observation)
    out = run("play", "sokoban", "--seed", "3", stdin="bogus\n" + "\n".join(moves) + "\n")
    assert out.returncode == 0, out.stderr
    assert expected_first_prompt in out.stdout
    assert "INVALID" in out.stdout  # "bogus" is not an action
    assert "won" in out.stdout and "not won" not in out.stdout


def test_play_unknown_env_is_a_clear_error():
    out = run("play", "no-such-env")
    assert out.returncode == 2
    assert "unknown" in out.stderr and "sokoban" in out.stderr
