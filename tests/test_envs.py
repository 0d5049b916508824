"""Contract tests every built-in environment must pass, plus parse_action, the registry and EnvGroups."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from envs import registry
from envs.treasure_hunt import TreasureHunt

# alfworld grounds every game with fast-downward (about a second a reset); tests/test_envs_alfworld.py runs the same
# contract on one shared env.
BUILTINS = [name for name in envs.list_envs() if name != "alfworld"]
# Blackjack cannot always be won; tests/test_envs_cards.py checks its expert against a baseline instead.
WINNABLE = [name for name in BUILTINS if name != "blackjack"]
INFO_KEYS = {"won", "is_action_valid", "admissible_actions", "anchor", "action"}


def act(action: str) -> str:
    return f"<action>{action}</action>"


def run_expert(env: envs.TextEnv, seed: int) -> tuple[bool, float]:
    """Play one episode with the env's expert; return (won, total reward)."""
    env.reset(seed=seed)
    total, done, info = 0.0, False, {}
    while not done:
        _, reward, terminated, truncated, info = env.step(act(env.expert_action() or "none"))
        total += reward
        done = terminated or truncated
    return info["won"], total


# ---- parse_action --------------------------------------------------------------------------------------------
_OPEN = re.compile("<action>", re.IGNORECASE | re.ASCII)


@given(st.text())
def test_parse_action_never_raises_and_needs_an_open_tag(reply: str) -> None:
    parsed = envs.parse_action(reply)
    if "<action>" not in reply.lower():
        assert parsed is None
    if parsed is not None:
        assert parsed == parsed.strip()


@given(
    prefix=st.text().filter(lambda t: not _OPEN.search(t)),
    body=st.text().filter(lambda t: "</action>" not in t.lower()),
    suffix=st.text(),
)
def test_parse_action_returns_the_first_tagged_text(prefix: str, body: str, suffix: str) -> None:
    assert envs.parse_action(f"{prefix}<action>{body}</action>{suffix}") == body.strip()


def test_parse_action_examples() -> None:
    assert envs.parse_action("think... <action> up </action>") == "up"
    assert envs.parse_action("<ACTION>Left</Action>") == "Left"
    assert envs.parse_action("<action>a</action><action>b</action>") == "a"
    assert envs.parse_action("<action></action>") == ""
    assert envs.parse_action("<action>up") is None
    assert envs.parse_action("up</action>") is None
    assert envs.parse_action("</action>x<action>y</action>") == "y"
    assert envs.parse_action(None) is None  # type: ignore[arg-type]


def test_parse_action_is_linear_on_adversarial_replies() -> None:
    start = time.perf_counter()
    assert envs.parse_action("<action>" * 200_000) is None
    assert envs.parse_action("<action>" + "x" * 2_000_000) is None
    assert time.perf_counter() - start < 1.0


# ---- the contract of every built-in --------------------------------------------------------------------------
@pytest.mark.parametrize("name", BUILTINS)
def test_check_env(name: str) -> None:
    check_env(envs.make(name).unwrapped, skip_render_check=True)


@pytest.mark.parametrize("name", BUILTINS)
def test_info_and_class_attributes(name: str) -> None:
    env = envs.make(name)
    assert env.name == name and env.task_description and env.max_steps >= 1
    obs, info = env.reset(seed=0)
    assert INFO_KEYS <= info.keys() and info["action"] is None and not info["won"]
    assert info["anchor"] == obs and hash(info["anchor"]) is not None
    assert env.render() == obs
    action = env.expert_action() or env.admissible_actions()[0]
    obs, _, _, _, info = env.step(f"Let me think. <action>  {action.upper()} </action> done")
    assert INFO_KEYS <= info.keys()
    assert info["is_action_valid"] and info["action"] == action
    assert obs in env.observation_space


@pytest.mark.parametrize("name", BUILTINS)
def test_prompt_has_task_state_actions_and_format(name: str) -> None:
    env = envs.make(name)
    obs, _ = env.reset(seed=1)
    prompt = env.build_prompt(obs)
    assert env.task_description in prompt and obs in prompt and "<action>" in prompt
    assert all(a in prompt for a in env.admissible_actions())
    assert "Recent history" not in prompt
    with_memory = env.build_prompt(obs, memory_text="step 1: you moved up")
    assert "Recent history:\nstep 1: you moved up" in with_memory


@pytest.mark.parametrize("name", BUILTINS)
def test_seeded_reset_and_steps_are_deterministic(name: str) -> None:
    def rollout(seed: int) -> list[tuple]:
        env = envs.make(name)
        obs, _ = env.reset(seed=seed)
        trace: list[tuple] = [(obs,)]
        for i in range(env.max_steps):
            reply = "garbage" if i % 3 == 2 else act(env.expert_action() or env.admissible_actions()[0])
            obs, reward, terminated, truncated, _ = env.step(reply)
            trace.append((obs, reward, terminated, truncated))
            if terminated or truncated:
                break
        return trace

    assert rollout(7) == rollout(7)
    first_obs = {envs.make(name).reset(seed=seed)[0] for seed in range(10)}
    assert len(first_obs) > 1


@pytest.mark.parametrize("name", WINNABLE)
def test_expert_wins_from_many_seeds(name: str) -> None:
    env = envs.make(name)
    assert all(run_expert(env, seed)[0] for seed in range(40))


@pytest.mark.parametrize("name", BUILTINS)
def test_invalid_replies_cost_a_step_and_truncate(name: str) -> None:
    env = envs.make(name)
    obs, info = env.reset(seed=3)
    for i in range(env.max_steps):
        new_obs, reward, terminated, truncated, info = env.step("no tags here")
        assert new_obs == obs and not info["is_action_valid"] and info["action"] is None
        assert reward == env.invalid_reward and not terminated
        assert truncated == (i == env.max_steps - 1)


_FRAGMENTS = ["<action>", "</action>", "<ACTION>", "</Action>", "<action", "action>", "up", "Left", "+", "=", "(",
              "hit", "stand", "10", " ", "\n", "√", "\x00", "é"]  # fmt: skip
REPLIES = st.one_of(
    st.text(),
    st.lists(st.sampled_from(_FRAGMENTS), max_size=12).map("".join),
    st.tuples(st.text(max_size=12), st.integers(100, 5_000)).map(lambda t: t[0] * t[1]),
)


@pytest.mark.parametrize("name", BUILTINS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replies=st.lists(REPLIES, min_size=1, max_size=4))
def test_step_never_raises_and_invalid_replies_change_nothing(name: str, replies: list[str]) -> None:
    env = envs.make(name)
    _, info = env.reset(seed=0)
    for reply in replies:
        anchor, legal = info["anchor"], [a.lower() for a in env.admissible_actions()]
        parsed = envs.parse_action(reply)
        obs, reward, terminated, truncated, info = env.step(reply)
        assert obs in env.observation_space and isinstance(reward, float)
        if parsed is None or parsed.lower() not in legal:
            assert not info["is_action_valid"] and info["anchor"] == anchor
        if terminated or truncated:
            break


# ---- registry --------------------------------------------------------------------------------------------------
def test_list_envs_is_sorted_and_complete() -> None:
    assert BUILTINS == sorted(BUILTINS)
    assert {"sokoban", "treasure_hunt", "numberline", "ezpoints", "points24", "blackjack"} <= set(BUILTINS)


def test_make_forwards_kwargs_and_accepts_import_paths() -> None:
    assert envs.make("sokoban", dim_room=(7, 8)).reset(seed=0)[0].count("\n") == 6
    env = envs.make("envs.treasure_hunt:TreasureHunt", size=4)
    assert isinstance(env, TreasureHunt) and env.size == 4


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_env", "sokoban"),
        ("no_such_env", "module:"),
        ("no_such_package_xyz:Env", "no_such_package_xyz"),
        ("envs.treasure_hunt:Missing", "Missing"),
        ("envs.base:parse_action", "not a TextEnv"),
        (":TreasureHunt", "bad import path"),
    ],
)
def test_make_errors_name_the_problem(target: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        envs.make(target)


def test_register(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    envs.register("tiny_hunt", TreasureHunt)
    envs.register("tiny_hunt", TreasureHunt)  # same entry again: allowed
    assert "tiny_hunt" in envs.list_envs()
    assert isinstance(envs.make("tiny_hunt", size=3, num_walls=1), TreasureHunt)
    with pytest.raises(ValueError, match="already registered"):
        envs.register("tiny_hunt", "envs.sokoban:Sokoban")


# ---- groups ----------------------------------------------------------------------------------------------------
def test_group_seeds_are_deterministic_distinct_and_split_disjoint() -> None:
    seeds = envs.group_seeds(5, 3, 64, "train")
    assert seeds.dtype == np.int64 and seeds.shape == (64,) and len(set(seeds.tolist())) == 64
    np.testing.assert_array_equal(seeds, envs.group_seeds(5, 3, 64, "train"))
    assert not np.array_equal(seeds, envs.group_seeds(5, 4, 64, "train"))
    assert not np.array_equal(seeds, envs.group_seeds(6, 3, 64, "train"))
    train = np.concatenate([envs.group_seeds(0, i, 256, "train") for i in range(50)])
    val = np.concatenate([envs.group_seeds(0, i, 256, "val") for i in range(50)])
    assert np.all(train % 2 == 0) and np.all(val % 2 == 1)
    assert not set(train.tolist()) & set(val.tolist())
    with pytest.raises(ValueError):
        envs.group_seeds(0, 0, 4, "test")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["sokoban", "blackjack"])
def test_env_groups_share_initial_state_within_a_group(name: str) -> None:
    groups = envs.EnvGroups(name, n_groups=4, group_size=3)
    np.testing.assert_array_equal(groups.group_ids, np.repeat(np.arange(4), 3))
    obs, infos = groups.reset(envs.group_seeds(0, 0, 4, "train"))
    assert len(obs) == len(infos) == len(groups) == 12
    by_group = [set(obs[g * 3 : (g + 1) * 3]) for g in range(4)]
    assert all(len(members) == 1 for members in by_group)
    if name == "sokoban":  # four random 6x6 rooms; blackjack hands may repeat by chance
        assert len(set.union(*by_group)) == 4
    # Same seed and same replies: group members stay in lockstep, randomness in `step` included.
    replies = [act(env.expert_action() or "stand") for env in groups.envs[:3]] * 4
    obs, *_ = groups.step(replies)
    assert len(set(obs[:3])) == 1


def test_env_groups_step_only_live_envs() -> None:
    groups = envs.EnvGroups("numberline", n_groups=2, group_size=2, env_kwargs={"max_position": 3})
    assert groups.all_done  # nothing to step before the first reset
    groups.reset([11, 12])
    steps = 0
    while not groups.all_done:
        # Env 0 plays the expert; the others reply nothing useful until they truncate.
        replies = [act(env.expert_action()) if i == 0 else None for i, env in enumerate(groups.envs)]
        replies = [None if groups.done[i] else r for i, r in enumerate(replies)]
        was_done = groups.done.copy()
        obs, rewards, terminated, truncated, infos = groups.step(replies)
        steps += 1
        for i in np.flatnonzero(was_done):
            assert obs[i] is None and infos[i] is None and rewards[i] == 0 and not terminated[i] | truncated[i]
        for i in np.flatnonzero(~was_done):
            assert isinstance(obs[i], str) and infos[i]["is_action_valid"] == (i == 0)
    assert steps == groups.envs[0].max_steps
    with pytest.raises(ValueError):
        groups.step([None])
    with pytest.raises(ValueError):
        groups.reset([1, 2, 3])
