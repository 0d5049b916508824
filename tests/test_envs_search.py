"""The Search-R1-style search env: reply format, rewards, the synthetic encyclopedia, retrievers and loaders."""

from __future__ import annotations

import dataclasses
import json

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
import memory
from envs.data.encyclopedia import build_encyclopedia, load_qa
from envs.retrieval import BM25Retriever, DenseRetriever, Retriever, load_corpus
from envs.search import SearchEnv, exact_match, normalize_answer, token_f1


def run_expert(env: SearchEnv, seed: int) -> tuple[dict, list[str]]:
    """One expert episode; the final info and every passage the searches returned."""
    env.reset(seed=seed)
    seen: list[str] = []
    while True:
        _, _, terminated, truncated, info = env.step(env.expert_action())
        seen += info.get("results") or []
        if terminated or truncated:
            return info, seen


def test_check_env_and_registry() -> None:
    env = envs.make("search")
    assert isinstance(env, SearchEnv) and env.max_steps == 4
    check_env(env.unwrapped, skip_render_check=True)


def test_search_then_answer() -> None:
    env = SearchEnv()
    obs, info = env.reset(seed=0)
    assert obs.startswith("Question: ") and "<information>" not in obs
    question = env.question
    obs, reward, terminated, _, info = env.step("I should look it up. <search> " + question.hops[0].upper() + " </search>")
    assert info["is_action_valid"] and info["query"] == question.hops[0].lower() and reward == 0.0 and not terminated
    assert len(info["results"]) == 3 and "<information>\nDoc 1: " in obs
    obs2, reward, terminated, _, info = env.step("<search></search>")  # empty query: invalid, nothing moves
    assert obs2 == obs and not info["is_action_valid"]
    _, reward, terminated, _, info = env.step(f"<answer>The {question.answers[0]}.</answer>")
    assert reward == 1.0 and terminated and info["won"] and info["query"] is None


def test_wrong_answer_and_f1_reward() -> None:
    env = SearchEnv(reward="f1")
    env.reset(seed=0)
    env.question = dataclasses.replace(env.question, answers=("Grand Central Station",))
    _, reward, terminated, _, info = env.step("<answer>central station</answer>")
    assert terminated and not info["won"] and reward == pytest.approx(0.8)
    env = SearchEnv()
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("<answer>nobody knows</answer>")
    assert terminated and reward == 0.0 and not info["won"]


def test_answer_normalisation() -> None:
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert exact_match("an apple", ["Apple"]) and not exact_match("apples", ["apple"])
    assert token_f1("red apple pie", ["apple pie"]) == pytest.approx(0.8) and token_f1("", ["x"]) == 0.0


def test_max_turns_truncate() -> None:
    env = SearchEnv(max_steps=2)
    env.reset(seed=0)
    assert not env.step("<search>a b c</search>")[3]
    _, reward, terminated, truncated, _ = env.step("<search>d e f</search>")
    assert truncated and not terminated and reward == 0.0


def test_encyclopedia_is_deterministic_and_has_two_hop_questions() -> None:
    enc = build_encyclopedia(0)
    fresh = build_encyclopedia.__wrapped__(0)
    assert fresh.passages == enc.passages and fresh.questions == enc.questions
    assert build_encyclopedia.__wrapped__(1).passages != enc.passages
    assert len(enc.passages) >= 200 and sum(len(q.hops) == 2 for q in enc.questions) >= 200


def test_two_hop_questions_are_answerable_by_the_expert_with_bm25_top3() -> None:
    env = SearchEnv(retriever="bm25", top_k=3)
    two_hop = 0
    for seed in range(120):
        info, seen = run_expert(env, seed)
        assert info["won"], seed
        if len(env.question.hops) == 2:
            two_hop += 1
            assert any(env.question.answers[0] in passage for passage in seen), env.question
    assert two_hop >= 30


def test_dense_retriever_finds_the_passages() -> None:
    enc = build_encyclopedia(0)
    dense = DenseRetriever(enc.passages, batch_size=128)
    assert isinstance(dense, Retriever)
    questions = [q for q in enc.questions if len(q.hops) == 1][:40]
    results = dense.search([q.hops[0] for q in questions], 3)
    hits = sum(any(q.answers[0] in p for p in res) for q, res in zip(questions, results, strict=True))
    assert hits >= 0.7 * len(questions)
    env = SearchEnv(retriever=dense)
    info, _ = run_expert(env, 0)
    assert info["won"]


def test_any_retriever_object_and_memory() -> None:
    class Fixed:
        def search(self, queries: list[str], k: int) -> list[list[str]]:
            return [[f"passage about {q}"] * k for q in queries]

    env = SearchEnv(retriever=Fixed(), top_k=2)
    obs, _ = env.reset(seed=0)
    mem = memory.make("search")
    next_obs, reward, _, _, info = env.step("<search>cats</search>")
    mem.store(obs, info["action"], reward, info)
    assert info["results"] == ["passage about cats"] * 2
    assert "Query: cats" in mem.render() and "passage about cats" in mem.render()
    with pytest.raises(ValueError):
        SearchEnv(retriever="grep")


def test_user_corpus_and_questions(tmp_path) -> None:
    corpus, qa = tmp_path / "corpus.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text('{"id": "0", "contents": "\\"Zorbia\\"\\nZorbia is a land of blue mountains."}\n'
                      '{"title": "Quello", "text": "Quello is a river that flows north."}\n\n')
    qa.write_text(json.dumps({"question": "Which way does Quello flow?", "golden_answers": ["north", "N"]}) + "\n"
                  + json.dumps({"question": "What colour are Zorbia's mountains?", "answer": "blue"}) + "\n")
    assert load_corpus(corpus) == ["Zorbia: Zorbia is a land of blue mountains.",
                                   "Quello: Quello is a river that flows north."]
    assert [q.answers for q in load_qa(qa)] == [("north", "N"), ("blue",)]
    env = SearchEnv(corpus=str(corpus), qa=str(qa), top_k=1)
    for seed in range(4):
        info, seen = run_expert(env, seed)
        assert info["won"] and any(env.question.answers[0] in p for p in seen)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match="golden_answers"):
        load_qa(bad)
    with pytest.raises(ValueError, match="qa="):
        SearchEnv(corpus=str(corpus))


def test_bm25_retriever_basics() -> None:
    r = BM25Retriever(["red cotton shirts", "blue jeans", "the cities of Peltria"])
    assert r.search(["shirt", "city", "zzz"], 2) == [["red cotton shirts"], ["the cities of Peltria"], []]
    assert r.search([], 3) == []


def test_deterministic_under_seed() -> None:
    def trace(seed: int) -> list:
        env = SearchEnv()
        out = [env.reset(seed=seed)[0]]
        for i in range(4):
            step = env.step("junk" if i == 1 else env.expert_action())
            out.append(step[:4])
            if step[2] or step[3]:
                break
        return out

    assert trace(3) == trace(3) and trace(3) != trace(4)


_FRAGMENTS = ["<search>", "</search>", "<answer>", "</answer>", "<SEARCH>", "<action>", "</action>", "paris", " ",
              "\n", "é", "\x00", "<"]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.text(), st.lists(st.sampled_from(_FRAGMENTS), max_size=10).map("".join)), max_size=5))
def test_step_never_raises(replies: list[str]) -> None:
    env = SearchEnv()
    _, info = env.reset(seed=1)
    for reply in replies:
        anchor = info["anchor"]
        obs, reward, terminated, truncated, info = env.step(reply)
        assert obs in env.observation_space and isinstance(reward, float)
        if not info["is_action_valid"]:
            assert info["anchor"] == anchor
        if terminated or truncated:
            break
