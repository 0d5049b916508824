"""Held-out data never overlaps training data: generated envs by seed parity, data-pool envs by disjoint pools,
ALFWorld by its own splits; the training config's validation and `raygent eval` pick the held-out side."""

from __future__ import annotations

import json

import numpy as np
import pytest

import envs
from actors.config import load_train_config
from envs.base import split_pool


def test_split_pool_is_disjoint_and_complete():
    items = list(range(95))
    train, test = split_pool(items, "train"), split_pool(items, "test")
    assert not set(train) & set(test) and sorted(train + test) == items
    assert len(test) == 10 and split_pool(items, "all") == items
    with pytest.raises(ValueError, match="split"):
        split_pool(items, "dev")


def test_search_questions_held_out():
    train, test = envs.make("search"), envs.make("search", split="test")
    questions = lambda env: {q.question for q in env.questions}  # noqa: E731
    assert questions(train) and questions(test) and not questions(train) & questions(test)
    for seed in range(20):  # whatever the seed, a test episode asks a test question
        test.reset(seed=seed)
        assert test.question.question in questions(test)


def test_webshop_goals_held_out():
    train, test = envs.make("webshop", num_products=300), envs.make("webshop", num_products=300, goal_split="test")
    instructions = lambda env: {g.instruction for g in split_pool(env.catalog.goals, env.goal_split)}  # noqa: E731
    assert not instructions(train) & instructions(test)
    test.reset(seed=3)
    assert test.goal.instruction in instructions(test)


def test_math_tool_file_problems_held_out(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"})
                              for i in range(40)) + "\n")
    seen = {split: set() for split in ("train", "test")}
    for split in seen:
        env = envs.make("math_tool", data=str(path), split=split)
        for seed in range(60):
            env.reset(seed=seed)
            seen[split].add(env.problem.question)
    assert seen["train"] and seen["test"] and not seen["train"] & seen["test"]


def test_generated_envs_split_by_seed_parity():
    train = envs.group_seeds(0, 3, 64, "train")
    val = envs.group_seeds(0, 0, 256, "val")
    assert (train % 2 == 0).all() and (val % 2 == 1).all()
    assert not set(train.tolist()) & set(val.tolist())


@pytest.mark.parametrize(("env", "kwargs", "split", "want"), [
    ("search", {}, None, {"split": "test"}),
    ("webshop", {"num_products": 300}, None, {"goal_split": "test"}),
    ("alfworld", {}, "valid_unseen", {"split": "valid_unseen"}),
    ("sokoban", {"dim_room": [6, 6]}, None, {}),
])
def test_validation_plays_the_heldout_split(env, kwargs, split, want):
    cfg = load_train_config({"env": {"name": env, "kwargs": kwargs},
                             "validation": {"split": split} if split else {}})
    val = cfg.validation_env_kwargs
    assert {k: val[k] for k in want} == want and {k: val[k] for k in kwargs} == kwargs
    card = cfg.agent_card()
    assert card.heldout_kwargs == want


def test_alfworld_unseen_floor_plans_are_not_training_plans():
    from envs.alfworld_env import generate_game

    plans = {split: {generate_game(np.random.default_rng(s), "pick_and_place_simple", split)[1]["scene"]
                     for s in range(12)} for split in ("train", "valid_unseen")}
    assert plans["train"] and plans["valid_unseen"] and not plans["train"] & plans["valid_unseen"]
