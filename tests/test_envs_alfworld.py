"""The alfworld env on the real engine: the env contract, generated-task solvability, official-data loading.

Loading a game grounds it with fast-downward (about a second for a kitchen), so one env serves most tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("alfworld", reason="needs the alfworld extra: pip install 'raygent[alfworld]'")

import envs  # noqa: E402
from envs.alfworld_env import TASK_TYPES, AlfWorld, alfworld_task_success, generate_game  # noqa: E402


def act(action: str) -> str:
    return f"<action>{action}</action>"


@pytest.fixture(scope="module")
def env() -> AlfWorld:
    return envs.make("alfworld")


def play_expert(env: AlfWorld, seed: int, task_type: str | None = None) -> tuple[dict, float, int]:
    _, info = env.reset(seed=seed, options={"task_type": task_type} if task_type else None)
    total, steps, done = 0.0, 0, False
    while not done:
        _, reward, terminated, truncated, info = env.step(act(env.expert_action() or "look"))
        total, steps, done = total + reward, steps + 1, terminated or truncated
    return info, total, steps


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_generated_tasks_are_solved_by_the_planner(env: AlfWorld, task_type: str) -> None:
    for seed in (0, 1):
        info, total, steps = play_expert(env, seed, task_type)
        assert info["won"] and info["task_type"] == task_type and info["goal_condition_success"] == 1.0
        assert total == 1.0 and steps < env.max_steps


def test_reset_and_generation_are_deterministic(env: AlfWorld) -> None:
    first = env.reset(seed=4)[0], env.admissible_actions()
    other = env.reset(seed=5)[0]
    assert env.reset(seed=4)[0] == first[0] and env.admissible_actions() == first[1] and other != first[0]
    game_a, task_a = generate_game(np.random.default_rng(9), "pick_heat_then_place_in_recep", "valid_unseen")
    game_b, task_b = generate_game(np.random.default_rng(9), "pick_heat_then_place_in_recep", "valid_unseen")
    assert game_a == game_b and task_a == task_b and task_a["scene"] in {"FloorPlan1", "FloorPlan2", "FloorPlan3"}


def test_check_env_and_info(env: AlfWorld) -> None:
    check_env(env.unwrapped, skip_render_check=True)
    obs, info = env.reset(seed=2)
    assert "Your task is to:" in obs and info["anchor"] == obs and obs in env.observation_space
    assert {"won", "is_action_valid", "admissible_actions", "anchor", "action", "task_type"} <= info.keys()
    assert "look" in info["admissible_actions"] and info["task_type"] in TASK_TYPES
    action = info["admissible_actions"][0]
    obs, reward, terminated, _, info = env.step(f"I think... <action> {action.upper()} </action>")
    assert info["is_action_valid"] and info["action"] == action and reward == 0.0 and not terminated
    assert "Your task is to:" in obs and info["anchor"] == obs  # the goal is restated after every step
    prompt = env.build_prompt(obs)
    assert env.task_description in prompt and obs in prompt
    assert all(a in prompt for a in env.admissible_actions())


def test_expert_replans_after_detours_and_goal_conditions_pay_once(env: AlfWorld) -> None:
    shaped = AlfWorld(goal_condition_reward=0.5, max_steps=40)
    shaped.reset(seed=1, options={"task_type": "pick_heat_then_place_in_recep"})
    for action in shaped.admissible_actions()[:2]:  # two detours off the plan: walk somewhere else first
        shaped.step(act(action))
    rewards, info = [], {}
    while not info.get("won"):
        _, reward, terminated, truncated, info = shaped.step(act(shaped.expert_action()))
        rewards.append(reward)
        assert not truncated
    # Heating earns half the conditions (0.25), the winning move the other half (0.25) plus the success reward.
    assert sorted(rewards)[-2:] == [0.25, 1.25] and sum(rewards) == 1.5


REPLIES = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(["<action>", "</action>", "go to", " drawer 1", "look", "\x00", "é", "\t"]),
             max_size=8).map("".join),
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(replies=st.lists(REPLIES, min_size=1, max_size=3))
def test_step_never_raises_on_arbitrary_replies(env: AlfWorld, replies: list[str]) -> None:
    _, info = env.reset(seed=0)  # the same game each time: no re-grounding
    for reply in replies:
        anchor, legal = info["anchor"], [a.lower() for a in env.admissible_actions()]
        parsed = envs.parse_action(reply)
        obs, reward, terminated, truncated, info = env.step(reply)
        assert obs in env.observation_space and isinstance(reward, float)
        if parsed is None or parsed.lower() not in legal:
            assert not info["is_action_valid"] and info["anchor"] == anchor and reward == env.invalid_reward


def test_invalid_replies_truncate_at_max_steps() -> None:
    short = AlfWorld(max_steps=3, task_types=["pick_and_place_simple"])
    short.reset(seed=0)
    results = [short.step("no tags")[2:4] for _ in range(3)]
    assert results == [(False, False), (False, False), (False, True)]


def test_task_success_helper() -> None:
    infos = [{"task_type": "pick_and_place_simple", "won": True}, {"task_type": "pick_and_place_simple", "won": False},
             {"task_type": "look_at_obj_in_light", "won": True}]
    assert alfworld_task_success(infos) == {"all": 2 / 3, "look_at_obj_in_light": 1.0, "pick_and_place_simple": 0.5}
    assert alfworld_task_success([]) == {}


def test_loads_official_layout_when_alfworld_data_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Official files as alfworld-generate writes them: json_2.1.1/<split>/<task>-<obj>-<mrecep>-<recep>-<scene>/
    # <trial>/{game.tw-pddl, traj_data.json}. The games here are generated ones, saved in that layout.
    for task_type in ("pick_cool_then_place_in_recep", "look_at_obj_in_light"):
        game, task = generate_game(np.random.default_rng(3), task_type, "valid_seen")
        trial = tmp_path / "json_2.1.1" / "valid_seen" / f"{task_type}-X-None-Y-1" / "trial_T0"
        trial.mkdir(parents=True)
        (trial / "game.tw-pddl").write_text(json.dumps(game))
        (trial / "traj_data.json").write_text(json.dumps({"task_type": task_type, "pddl_params": task["pddl_params"],
                                                          "scene": {"floor_plan": 1}}))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    official = AlfWorld(split="valid_seen", task_types=["pick_cool_then_place_in_recep"])
    info, total, _ = play_expert(official, seed=0)
    assert info["won"] and total == 1.0 and info["gamefile"].endswith("game.tw-pddl")
    assert info["task_type"] == "pick_cool_then_place_in_recep"
    with pytest.raises(FileNotFoundError, match="pick_two_obj_and_place"):
        AlfWorld(split="valid_seen").reset(seed=0, options={"task_type": "pick_two_obj_and_place"})
    assert AlfWorld(split="train").reset(seed=0)[1]["gamefile"].startswith("generated:")  # no train folder there
    with pytest.raises(FileNotFoundError, match="json_2.1.1/train"):
        AlfWorld(data_path=str(tmp_path)).reset(seed=0)


def test_bad_arguments_fail_early() -> None:
    with pytest.raises(ValueError, match="split"):
        AlfWorld(split="test")
    with pytest.raises(ValueError, match="task_types"):
        AlfWorld(task_types=["pick_and_slice"])


def test_raygent_play_alfworld() -> None:
    raygent = str(Path(sys.executable).with_name("raygent"))
    out = subprocess.run([raygent, "play", "alfworld", "--seed", "0"], input="bogus\nlook\n", capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Your task is to:" in out.stdout and "INVALID" in out.stdout and "valid action 'look'" in out.stdout
