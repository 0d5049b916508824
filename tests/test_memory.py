"""Memory modules, without Ray: bounded prompts, budgets, milestones, search history, selection by name."""

from __future__ import annotations

import pytest

import envs
import memory


def play_prompts(env_name: str, mem, steps: int, seed: int = 0, **env_kwargs) -> list[str]:
    """The prompt the agent sees before each step, cycling through the admissible actions (invalid every 7th)."""
    env = envs.make(env_name, **env_kwargs)
    observation, info = env.reset(seed=seed)
    mem.reset()
    prompts = []
    for t in range(steps):
        prompts.append(env.build_prompt(observation, mem.render()))
        actions = info["admissible_actions"] or ["up"]
        reply = "no tags here" if t % 7 == 6 else f"<action>{actions[t % len(actions)]}</action>"
        next_observation, reward, terminated, truncated, info = env.step(reply)
        mem.store(observation, info["action"], reward, info)
        observation = next_observation
        if terminated or truncated:
            observation, info = env.reset(seed=seed + t + 1)
    return prompts


def test_prompt_length_is_bounded_with_simple_memory():
    prompts = play_prompts("sokoban", memory.SimpleMemory(k=2), steps=50, max_steps=100)
    assert len(prompts[49]) <= 1.2 * len(prompts[4])


def test_prompt_length_is_bounded_for_every_builtin_env():
    # alfworld is left out: its engine needs seconds per reset and its feedback text varies by design.
    for name in [n for n in envs.list_envs() if n != "alfworld"]:
        prompts = play_prompts(name, memory.SimpleMemory(k=2), steps=50)
        assert max(map(len, prompts[4:])) <= 1.5 * len(prompts[4]) + 200, name


def test_simple_memory_shows_the_last_k_steps():
    mem = memory.SimpleMemory(k=2)
    for i in range(5):
        mem.store(f"obs{i}", f"act{i}", -0.1, {})
    text = mem.render()
    assert "obs3" in text and "obs4" in text and "obs2" not in text
    assert "Step 5: action act4" in text
    mem.store("obs5", None, -0.1, {})
    assert "(invalid reply)" in mem.render()
    mem.reset()
    assert mem.render() == ""
    assert memory.SimpleMemory(k=0).render() == ""


def test_sliding_window_keeps_the_newest_steps_within_budget():
    mem = memory.SlidingWindowMemory(max_chars=200)
    for i in range(20):
        mem.store(f"observation number {i}", "up", 0.0, {})
        assert len(mem.render()) <= 200
    assert "observation number 19" in mem.render()
    assert "observation number 0\n" not in mem.render()
    one_huge = memory.SlidingWindowMemory(max_chars=50)
    one_huge.store("x" * 500, "left", 0.0, {})
    assert len(one_huge.render()) == 50 and one_huge.render().endswith("x")


def test_sliding_window_token_budget_uses_the_tokenizer():
    class WordTokenizer:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    mem = memory.SlidingWindowMemory(max_tokens=30, tokenizer=WordTokenizer())
    for i in range(10):
        mem.store(f"a b c d e {i}", "up", 0.0, {})
    assert len(mem.render().split()) <= 30
    with pytest.raises(ValueError, match="tokenizer"):
        memory.SlidingWindowMemory(max_tokens=10)


def test_key_event_memory_keeps_milestones_beyond_the_window():
    mem = memory.KeyEventMemory(k=1)
    mem.store("o1", "up", 1.0, {"key_event": "box pushed onto target"})
    for i in range(10):
        mem.store(f"o{i + 2}", "down", -0.1, {})
    text = mem.render()
    assert "Step 1: box pushed onto target" in text
    assert "Step 11: action down" in text and "Step 10:" not in text


def test_key_event_memory_with_sokoban_milestones():
    env = envs.make("sokoban")
    mem = memory.KeyEventMemory(k=2)
    for seed in range(50):
        observation, info = env.reset(seed=seed)
        mem.reset()
        terminated = False
        while not terminated:
            action = env.expert_action()
            observation_next, reward, terminated, truncated, info = env.step(f"<action>{action}</action>")
            mem.store(observation, info["action"], reward, info)
            observation = observation_next
            if truncated:
                break
        if info["won"]:
            assert "all boxes on targets" in mem.render()
            return
    pytest.fail("the expert never solved a room")


def test_search_memory_records_queries_and_results():
    mem = memory.SearchMemory(max_queries=2, max_result_chars=10)
    mem.store("q?", "capital of France", 0.0, {"results": ["Paris is the capital", "France"]})
    mem.store("q?", None, 0.0, {})  # an invalid reply is not a query
    mem.store("q?", "ignored", 0.0, {"query": "river of Paris", "results": "Seine"})
    mem.store("q?", "third", 0.0, {"results": "r3"})
    text = mem.render()
    assert "capital of France" not in text  # only the newest two stay
    assert "Query: river of Paris\nResults:\nSeine" in text and "Query: third" in text


def test_make_by_name_and_import_path_and_errors():
    assert isinstance(memory.make("simple", k=3), memory.SimpleMemory)
    assert isinstance(memory.make("memory.modules:KeyEventMemory"), memory.KeyEventMemory)
    for name in memory.MEMORIES:
        assert isinstance(memory.make(name), memory.Memory)
    with pytest.raises(ValueError, match="allowed"):
        memory.make("nope")
    with pytest.raises(ValueError, match="could not be imported"):
        memory.make("memory.modules:Nope")
    with pytest.raises(ValueError, match="lacks"):
        memory.make("collections:OrderedDict")
