"""Conversation mode (actors/conversation.py) without Ray: the token list a conversation trains on, its masks and
limits, tool turns, the rows the batch makes of it, GiGPO per turn, the trainer's log-probs over it, and the config
rules. A scripted generate stands in for the engine where the model's quality does not matter; the built-in real
model's tokenizer checks the template deltas against a real chat template."""

from __future__ import annotations

import asyncio

import numpy as np
import pyarrow as pa
import pytest
from transformers import AutoTokenizer

import envs
import memory
from actors.conversation import AgentLoop, ConversationOver, chat_deltas, next_turn
from actors.episodes import play, policy_decider
from envs.tools import tool
from tests.conftest import TOOLS_TEMPLATE, load_tokenizer

TOKENIZERS = ["default:tiny", "smollm2-135m", "smollm2-135m+tools"]  # +tools: a template that reads `tools=`

REPLIES = [
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>',
    "Let me see <tool_call>{not json</tool_call>",
    '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "explode", "arguments": {"x": 1}}</tool_call>',
    "no tags at all",
    "<answer>5</answer>",
]


@tool
def explode(x: int) -> str:
    """A tool that always raises."""
    raise RuntimeError(f"boom {x}")


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request):
    return load_tokenizer(request.param)


def scripted(tokenizer, replies, stop_with_eos=True):
    """A generate callable that answers `replies` in order with their canonical tokens (+ EOS), cut at the
    request's max_tokens as an engine would, and log-probs that say which reply and token they are."""
    script = iter(replies)
    calls: list[dict] = []

    async def generate(prompt, sampling):
        text = next(script)
        ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if stop_with_eos else [])
        ids = ids[:sampling["max_tokens"]]
        calls.append({"prompt": list(prompt), "max_tokens": sampling["max_tokens"]})
        return {"text": text, "token_ids": ids, "logprobs": [-(len(calls) + k / 100) for k in range(len(ids))],
                "weight_version": len(calls)}

    generate.calls = calls
    return generate


def play_math(tokenizer, replies, budget=4096, max_steps=6, max_tokens=256, stop_with_eos=True):
    env = envs.make("math_tool", max_steps=max_steps, tools=["calculator", explode])
    generate = scripted(tokenizer, replies, stop_with_eos)
    decide = policy_decider(tokenizer, generate, {"max_tokens": max_tokens, "temperature": 1.0},
                            max_model_len=8192, loop=AgentLoop("conversation", budget))
    episode = asyncio.run(play(env, memory.make("none"), decide, seed=3))
    return episode, generate


def reference_messages(tokenizer, episode):
    """The whole conversation as chat messages, from a fresh env replaying the episode's replies."""
    chat = chat_deltas(tokenizer)
    env = envs.make("math_tool", max_steps=6, tools=["calculator", explode])
    observation, _ = env.reset(seed=3)
    messages = [{"role": "user", "content": env.build_prompt(observation, "")}]
    for s in episode.steps:
        observation, _, terminated, truncated, info = env.step(s.reply)
        messages.append({"role": "assistant", "content": s.reply})
        if not (terminated or truncated):
            messages += chat.as_template_messages(env.followup_messages(observation, info))
    return messages


def render_reference(tokenizer, messages):
    """The template's token ids of a whole conversation, with math_tool's tool schemas where it reads `tools=` (as
    the conversation's first prompt has them)."""
    native = chat_deltas(tokenizer).tool_messages == "native"
    tools = envs.make("math_tool", tools=["calculator", explode]).tool_schemas() if native else None
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False),
                            add_special_tokens=False)


def first_difference(a, b) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def test_a_six_turn_episode_trains_the_engines_tokens_plus_template_deltas(tokenizer):
    """Tool results, a malformed call, an unknown tool, a tool that raises, a reply without tags, then the answer:
    the ids are the reference rendering of the whole conversation token for token (the templates are append-only),
    the mask covers exactly the engine's tokens with their log-probs, and every prompt sent was the list so far."""
    episode, generate = play_math(tokenizer, REPLIES)
    c = episode.conversation
    assert episode.ended == "terminated" and len(episode.steps) == 6 == len(c.turns)
    reference = render_reference(tokenizer, reference_messages(tokenizer, episode))
    got = c.prompt_ids + c.response_ids
    # the reference's last assistant turn ends with the template's turn separator, which nothing follows here
    diff = first_difference(reference, got)
    assert diff is None, (f"first differing token at {diff}: reference {tokenizer.decode(reference[diff:diff + 8])!r}"
                          f" vs trained {tokenizer.decode(got[diff:diff + 8])!r}")
    assert got == reference[:len(got)] and len(reference) - len(got) <= 2

    mask = np.asarray(c.loss_mask)
    engine = np.zeros(len(c.response_ids), dtype=bool)
    for (start, end), s in zip(c.turns, episode.steps, strict=True):
        assert c.response_ids[start:end] == s.response_ids and c.logprobs[start:end] == s.logprobs
        engine[start:end] = True
    assert (mask.astype(bool) == engine).all()
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if not m)
    assert c.weight_versions == [1, 2, 3, 4, 5, 6]
    for k, call in enumerate(generate.calls):  # turn k's prompt: everything before its reply
        start = c.turns[k][0]
        assert call["prompt"] == c.prompt_ids + c.response_ids[:start]


def test_each_tool_failure_is_a_tool_message(tokenizer):
    """Bad JSON, an unknown tool and a tool that raises each answer as a tool turn (a `tool` message where the template
    reads tools, hermes <tool_response> where it does not) with the error; a reply without tags gets a user turn with
    the reply format."""
    episode, _ = play_math(tokenizer, REPLIES)
    messages = reference_messages(tokenizer, episode)
    env_turns = [m for m in messages[1:] if m["role"] != "assistant"]
    native = chat_deltas(tokenizer).tool_messages == "native"
    assert native == (tokenizer.chat_template == TOOLS_TEMPLATE)  # neither built-in template reads `tools`
    assert [m["role"] for m in env_turns] == ["tool" if native else "user"] * 4 + ["user"]
    tool_turns = [m["content"] for m in env_turns[:4]]
    if not native:
        assert all(t.startswith("<tool_response>") for t in tool_turns), tool_turns
        tool_turns = [t.split("\n")[1] for t in tool_turns]
    assert "5" in tool_turns[0] and "not valid JSON" in tool_turns[1]
    assert "unknown tool 'abacus'" in tool_turns[2] and "boom 1" in tool_turns[3]
    assert "<tool_response>" not in env_turns[4]["content"] and "<answer>" in env_turns[4]["content"]
    decoded = tokenizer.decode(episode.conversation.response_ids)
    assert all(t in decoded for t in tool_turns)
    if native:
        assert decoded.count("<|im_start|>tool\n") == 4


def test_a_delta_that_fills_the_budget_is_kept_and_one_token_over_ends_the_episode(tokenizer):
    first, _ = play_math(tokenizer, REPLIES[:1], max_steps=1)
    reply = len(first.conversation.response_ids)
    full, _ = play_math(tokenizer, REPLIES)
    delta = full.conversation.turns[1][0] - reply  # the tokens between reply 1 and reply 2

    exact, generate = play_math(tokenizer, REPLIES, budget=reply + delta)
    assert exact.ended == "token_budget" and len(exact.steps) == 1
    assert len(exact.conversation.response_ids) == reply + delta  # the tool's answer is in, no room to reply
    assert exact.conversation.loss_mask[reply:] == [0] * delta and len(generate.calls) == 1

    over, _ = play_math(tokenizer, REPLIES, budget=reply + delta - 1)
    assert over.ended == "token_budget" and len(over.conversation.response_ids) == reply

    # the room left caps the next reply's max_tokens
    capped, generate = play_math(tokenizer, REPLIES, budget=reply + delta + 5)
    assert generate.calls[1]["max_tokens"] == 5 and capped.ended == "token_budget"


def test_a_reply_cut_on_length_is_closed_with_eos_before_the_next_turn(tokenizer):
    """An engine reply without its EOS (max_tokens reached) gets the EOS from the template, masked out."""
    episode, _ = play_math(tokenizer, REPLIES[:2], max_steps=2, stop_with_eos=False)
    c = episode.conversation
    end = c.turns[0][1]
    assert c.response_ids[end] == tokenizer.eos_token_id and c.loss_mask[end] == 0
    reference = render_reference(tokenizer, reference_messages(tokenizer, episode))
    got = c.prompt_ids + c.response_ids
    assert got[:len(c.prompt_ids) + c.turns[1][0]] == reference[:len(c.prompt_ids) + c.turns[1][0]]


def test_the_context_limit_ends_a_conversation_with_its_reason():
    from app.default_model import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("default:tiny"))
    chat = chat_deltas(tok)
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(ConversationOver) as e:
        next_turn(chat, None, messages, budget=1000, reply_tokens=16, max_model_len=len(chat.first_prompt(messages)))
    assert e.value.reason == "prompt_too_long"


# ---- rows ---------------------------------------------------------------------------------------------------------
def _turn_table(anchors, rewards, valid=None):
    """Turn rows of one group (TURN_SCHEMA) for conversations given per turn: anchors[i][t], rewards[i][t]; each turn
    2 model tokens after 1 env token."""
    from actors.env_group import TURN_SCHEMA

    rows = {name: [] for name in TURN_SCHEMA.names}
    for i, (anchor, reward) in enumerate(zip(anchors, rewards, strict=True)):
        n = len(anchor)
        response = list(range(10, 10 + 3 * n - 1))
        mask = [1, 1] + [0, 1, 1] * (n - 1)
        for t in range(n):
            first = t == 0
            rows["prompt_ids"].append([1, 2, 3] if first else [])
            rows["response_ids"].append(response if first else [])
            rows["rollout_logprobs"].append([-0.5 * m for m in mask] if first else [])
            rows["loss_mask"].append(mask if first else [])
            rows["turn_start"].append(0 if first else 3 * t)
            rows["turn_end"].append(2 if first else 3 * t + 2)
            rows["reward"].append(reward[t])
            rows["valid"].append(True if valid is None else valid[i][t])
            rows["anchor"].append(anchor[t])
            rows["action"].append(None)
            rows["group_id"].append(0)
            rows["traj_id"].append(i)
            rows["step"].append(t)
            rows["weight_version"].append(7 - t)
            rows["env_seed"].append(1)
            rows["sampling_seed"].append(i)
    return pa.table(rows, schema=TURN_SCHEMA)


def test_gigpo_per_turn_matches_a_hand_computed_example():
    """Two conversations of one group over anchors s0 -> s1; A wins (rewards 0, 1), B does not (0, 0). mean_norm,
    gamma 0.95, step weight 1: episode level +-0.5; step group s0 holds returns 0.95 and 0 (+-0.475), s1 holds 1
    and 0 (+-0.5). So A's turns get 0.975 and 1.0 on their tokens, B's -0.975 and -1.0, and env tokens 0."""
    from actors.batch import prepare_block
    from actors.config import AlgorithmConfig

    algo = AlgorithmConfig(estimator="gigpo", params={"gamma": 0.95, "step_weight": 1.0, "mode": "mean_norm"},
                           invalid_action_penalty=0.0)
    out = prepare_block(_turn_table([["s0", "s1"], ["s0", "s1"]], [[0.0, 1.0], [0.0, 0.0]]), algo).to_pydict()
    assert out["traj_id"] == [0, 1] and out["turns"] == [2, 2] and out["turn_anchors"] == [["s0", "s1"]] * 2
    np.testing.assert_allclose(out["token_advantages"][0], [0.975, 0.975, 0.0, 1.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(out["token_advantages"][1], [-0.975, -0.975, 0.0, -1.0, -1.0], atol=1e-6)
    assert out["loss_mask"][0] == [1, 1, 0, 1, 1] and out["response_ids"][0] == [10, 11, 12, 13, 14]
    assert out["reward"] == [1.0, 0.0] and out["weight_version"] == [6, 6]  # the oldest turn's version
    assert out["advantage"][0] == pytest.approx(0.9875)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "drgrpo", "reinforce_pp"])
def test_episode_level_estimators_give_every_turn_the_conversations_advantage(estimator):
    from actors.batch import block_moments, finish_rows, prepare_block
    from actors.config import AlgorithmConfig

    algo = AlgorithmConfig(estimator=estimator, invalid_action_penalty=0.1)
    table = _turn_table([["a", "b", "c"], ["a", "b"], ["a"]], [[0, 0, 1], [0, 1], [0]],
                        valid=[[True, False, True], [True, True], [True]])
    prepared = prepare_block(table, algo)
    if "token_advantages" not in prepared.column_names:  # a whole-batch estimator: its second pass, as build_batch
        moments = block_moments(prepared).to_pydict()
        prepared = finish_rows(prepared, estimator=estimator, params={},
                               moments={k: v[0] for k, v in moments.items()})
    out = prepared.to_pydict()
    for adv, mask, a in zip(out["token_advantages"], out["loss_mask"], out["advantage"], strict=True):
        model = [x for x, m in zip(adv, mask, strict=True) if m]
        assert np.allclose(model, model[0]) and model[0] == pytest.approx(a, abs=1e-6)
        assert all(x == 0 for x, m in zip(adv, mask, strict=True) if not m)
    assert out["reward"] == pytest.approx([1.0, 1.0, 0.0])
    assert out["valid"] == [False, True, True]


# ---- the trainer over a conversation ------------------------------------------------------------------------------
def test_the_trainers_logprobs_over_a_conversation_equal_the_engines_per_turn():
    """The tiny model plays math_tool in conversation mode through the transformers engine (sampling, fp32); the
    trainer's log-probs of the whole conversation row, at the masked-in positions, equal what the engine reported
    for each turn (1e-3), and nothing else is compared."""
    import torch

    from actors.episodes import Coalescer, run_sync
    from actors.learner import collate, reply_values, token_logprobs
    from app.default_model import resolve_model
    from app.engines import in_process_send, make_engine

    path = resolve_model("default:tiny")
    engine = make_engine("hf", path, max_model_len=2048)
    generate = Coalescer(in_process_send(engine)).generate
    env = envs.make("math_tool", max_steps=4)
    decide = policy_decider(engine.tokenizer, generate, {"max_tokens": 24, "temperature": 1.0, "top_p": 1.0},
                            max_model_len=2048, sampling_seed=11, loop=AgentLoop("conversation", 600))
    episode = run_sync(play(env, memory.make("none"), decide, seed=5))
    c = episode.conversation
    assert len(c.turns) >= 2, episode.ended
    batch = collate([c.prompt_ids], [c.response_ids], pad_id=engine.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(engine.model.float(), batch)
    trainer = reply_values(logp, batch["response_mask"])[0]
    for start, end in c.turns:
        np.testing.assert_allclose(trainer[start:end], c.logprobs[start:end], atol=1e-3)


# ---- config ---------------------------------------------------------------------------------------------------------
def test_conversation_mode_refuses_a_memory_module():
    from actors.config import load_train_config

    base = {"env": {"name": "math_tool"}, "rollout": {"agent_loop": "conversation"},
            "policy": {"max_model_len": 2048}}
    with pytest.raises(ValueError, match="memory.name must be 'none'"):
        load_train_config({**base, "memory": {"name": "simple"}})
    with pytest.raises(ValueError, match="agent_loop"):
        load_train_config({**base, "rollout": {"agent_loop": "dialogue"}})
    cfg = load_train_config({**base, "memory": {"name": "none"}, "optim": {"loss_agg_mode": "seq-mean-token-sum-norm"}})
    assert cfg.loss_norm_length == cfg.rollout.conversation_tokens  # Dr. GRPO's constant for conversations
    card = cfg.agent_card()
    assert card.agent_loop == "conversation" and card.loop.max_tokens == cfg.rollout.conversation_tokens


def test_a_card_without_an_agent_loop_reads_as_step_mode():
    from actors.config import AgentCard

    card = AgentCard.model_validate({"format_version": 1, "env": {"name": "sokoban"}})
    assert card.agent_loop == "step" and card.loop.kind == "step"


# ---- the warm start on expert conversations -------------------------------------------------------------------------
def test_expert_conversations_train_the_experts_turns_only(tokenizer):
    """A player that follows the expert half the time: each row is a whole conversation as played, the expert's
    turns masked in (their tokens are the expert's label), the random turns and the env's tokens masked out."""
    from actors.demonstrations import make_demonstrations

    loop = AgentLoop("conversation", 4096)
    demos = make_demonstrations(tokenizer, "math_tool", {"max_steps": 4}, "none", {}, list(range(0, 24, 2)), 0.5, 7,
                                loop=loop)
    assert set(demos) == {"prompt_ids", "response_ids", "loss_mask"} and len(demos["prompt_ids"]) > 0
    random_turns = 0
    for response, mask in zip(demos["response_ids"], demos["loss_mask"], strict=True):
        assert len(mask) == len(response) and any(mask)
        trained = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if m])
        assert "<action>" in trained and trained.count("<action>") == trained.count(tokenizer.eos_token)
        replies = tokenizer.decode(response).count("<action>")
        random_turns += replies - trained.count("<action>")
    assert random_turns > 0  # off-expert turns stay in the history, untrained
    assert make_demonstrations(tokenizer, "math_tool", {"max_steps": 4}, "none", {}, list(range(0, 24, 2)), 0.5, 7,
                               loop=loop) == demos


def test_the_supervised_loss_counts_the_masked_in_tokens_only(tmp_path):
    import torch

    from actors.learner import collate, sft_step, token_logprobs
    from tests.update_helpers import build_model, load_model

    model = load_model(build_model(tmp_path / "m"))
    prompts = [[2, 3, 4], [5, 6]]
    responses = [[7, 8, 9, 10, 11], [12, 13, 14]]
    masks = [[1, 1, 0, 0, 1], [0, 1, 1]]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = sft_step(model, opt, prompts, responses, [0, 1], lr=0.0, micro_batch_size=1, grad_clip=1e9, pad_id=0,
                   device="cpu", loss_masks=masks, optimizer_steps=False)
    with torch.no_grad():
        batch = collate(prompts, responses, 0, values={"keep": masks})
        logp, _ = token_logprobs(model, batch)
    want = -float((logp * batch["keep"]).sum() / batch["keep"].sum())
    assert out["sft_loss"] == pytest.approx(want, rel=1e-5)
    unmasked = sft_step(model, opt, prompts, responses, [0, 1], lr=0.0, micro_batch_size=2, grad_clip=1e9, pad_id=0,
                        device="cpu", optimizer_steps=False)
    assert unmasked["sft_loss"] != pytest.approx(want, rel=1e-3)


# ---- a custom agent loop -------------------------------------------------------------------------------------------
def test_a_custom_loop_replies_twice_in_a_step_and_both_replies_get_the_steps_advantage(tokenizer):
    """`actors.agent_loops:FormatRetry` by import path: an unreadable reply gets a user nudge and a second reply in
    the same env step. The token list is the reference rendering of that conversation, both replies are trained,
    the nudge is not, and the turn rows give the step one span over both replies."""
    from actors.batch import prepare_block
    from actors.config import AlgorithmConfig
    from actors.conversation import AgentLoop
    from actors.env_group import records_table

    replies = ["no tags here", REPLIES[0], "<answer>5</answer>"]
    env = envs.make("math_tool", max_steps=6, tools=["calculator", explode])
    generate = scripted(tokenizer, replies)
    loop = AgentLoop.from_config("actors.agent_loops:FormatRetry", 4096)
    decide = policy_decider(tokenizer, generate, {"max_tokens": 256, "temperature": 1.0}, max_model_len=8192,
                            loop=loop)
    episode = asyncio.run(play(env, memory.make("none"), decide, seed=3))
    c = episode.conversation
    assert len(episode.steps) == 2 and c.steps == [0, 0, 1] and len(c.step_spans()) == 2
    assert episode.steps[0].reply == REPLIES[0]  # the env stepped with the repaired reply

    env2 = envs.make("math_tool", max_steps=6, tools=["calculator", explode])
    observation, _ = env2.reset(seed=3)
    nudge = decide.nudge.format(example=env2.example_action)
    messages = [{"role": "user", "content": env2.build_prompt(observation, "")},
                {"role": "assistant", "content": replies[0]}, {"role": "user", "content": nudge},
                {"role": "assistant", "content": replies[1]}]
    observation, _, _, _, info = env2.step(replies[1])
    messages += chat_deltas(tokenizer).as_template_messages(env2.followup_messages(observation, info))
    messages.append({"role": "assistant", "content": replies[2]})
    reference = render_reference(tokenizer, messages)
    got = c.prompt_ids + c.response_ids
    assert got == reference[:len(got)], first_difference(reference, got)
    trained = [t for t, m in zip(c.response_ids, c.loss_mask, strict=True) if m]
    assert trained == [t for s, e in c.turns for t in c.response_ids[s:e]]

    table = records_table([episode, episode], group_id=0, group_size=2)
    assert table["turn_start"].to_pylist()[:2] == [c.step_spans()[0][0], c.step_spans()[1][0]]
    row = prepare_block(table, AlgorithmConfig(estimator="grpo")).to_pydict()
    assert row["turns"] == [2, 2]
    start, end = c.step_spans()[0]
    assert set(row["token_advantages"][0][start:end]) == {row["token_advantages"][0][start]}  # one step, one value


def test_a_custom_loop_is_named_by_its_import_path():
    from actors.config import load_train_config

    base = {"env": {"name": "math_tool"}, "memory": {"name": "none"}, "policy": {"max_model_len": 2048}}
    cfg = load_train_config({**base, "rollout": {"agent_loop": "actors.agent_loops:FormatRetry"}})
    assert cfg.agent_loop.kind == "conversation" and cfg.agent_loop.custom == "actors.agent_loops:FormatRetry"
    assert cfg.agent_card().loop == cfg.agent_loop
    with pytest.raises(ValueError, match="args.rollout.agent_loop: cannot load agent loop"):
        load_train_config({**base, "rollout": {"agent_loop": "actors.agent_loops:Nope"}})
    with pytest.raises(ValueError, match="ConversationDecider"):
        load_train_config({**base, "rollout": {"agent_loop": "actors.episodes:Turn"}})
    with pytest.raises(ValueError, match="memory.name must be 'none'"):
        load_train_config({**base, "memory": {"name": "simple"},
                           "rollout": {"agent_loop": "actors.agent_loops:FormatRetry"}})


def test_replies_of_a_step_the_env_never_took_stay_untrained(tokenizer):
    """A loop whose retry hits the token budget ends the episode before the env steps: the reply it had written in
    that step stays in the conversation as context, masked out of the loss."""
    from actors.conversation import AgentLoop
    from actors.env_group import records_table

    replies = [REPLIES[0], "no tags", "again no tags"]
    full, _ = play_math(tokenizer, [REPLIES[0], "no tags"], max_steps=2)
    # room for reply 1, the tool result, reply 2 and part of the nudge only
    budget = len(full.conversation.response_ids) + 5
    env = envs.make("math_tool", max_steps=6, tools=["calculator", explode])
    decide = policy_decider(tokenizer, scripted(tokenizer, replies), {"max_tokens": 256, "temperature": 1.0},
                            max_model_len=8192, loop=AgentLoop.from_config("actors.agent_loops:FormatRetry", budget))
    episode = asyncio.run(play(env, memory.make("none"), decide, seed=3))
    assert episode.ended == "token_budget" and len(episode.steps) == 1 and len(episode.conversation.turns) == 2
    mask = records_table([episode], 0, 1)["loss_mask"].to_pylist()[0]
    start, end = episode.conversation.turns[1]
    assert sum(mask[start:end]) == 0 and sum(mask[slice(*episode.conversation.turns[0])]) > 0


def test_step_mode_episodes_still_make_one_row_per_step(tokenizer):
    """The same episode played in step mode: its block is step rows (RECORD_SCHEMA), each with its own bounded
    prompt and reply, no conversation columns."""
    from actors.env_group import RECORD_SCHEMA, records_table

    env = envs.make("math_tool", max_steps=6, tools=["calculator", explode])
    decide = policy_decider(tokenizer, scripted(tokenizer, REPLIES), {"max_tokens": 256, "temperature": 1.0},
                            max_model_len=8192)
    episode = asyncio.run(play(env, memory.make("none"), decide, seed=3))
    assert episode.conversation is None and len(episode.steps) == 6
    table = records_table([episode, episode], group_id=4, group_size=2)
    assert table.schema == RECORD_SCHEMA and table.num_rows == 12
    assert table["prompt_ids"].to_pylist()[:6] == [s.prompt_ids for s in episode.steps]
    assert table["traj_id"].to_pylist() == [8] * 6 + [9] * 6


def _task_file(tmp_path, name: str, agent_name: str | None) -> str:
    import json

    row = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "reward_model": {"ground_truth": "5"}}
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps({**row, **({"agent_name": agent_name} if agent_name else {})}) + "\n")
    return str(path)


def test_each_task_row_plays_the_loop_it_names(tmp_path):
    """verl's agent_name column: a row naming "retry" (mapped to FormatRetry) gets a nudge and a second reply in
    its first step; a row naming "tool_agent" (mapped by default to the plain conversation) and a row naming none
    step with each reply. Same replies, same default loop, three task rows."""
    tokenizer = load_tokenizer("default:tiny")
    loop = AgentLoop.from_config("conversation", 4096, {"retry": "actors.agent_loops:FormatRetry",
                                                         "tool_agent": "conversation"})
    steps = {}
    for name in ("retry", "tool_agent", None):
        env = envs.make("math_tool", data=_task_file(tmp_path, str(name), name), split="all")
        decide = policy_decider(tokenizer, scripted(tokenizer, ["no tags here", "<answer>5</answer>"]),
                                {"max_tokens": 64, "temperature": 1.0}, max_model_len=8192, loop=loop)
        episode = asyncio.run(play(env, memory.make("none"), decide, seed=0))
        assert episode.final_info["won"] and env.agent_name == name
        steps[name] = episode.conversation.steps
    assert steps == {"retry": [0, 0], "tool_agent": [0, 1], None: [0, 1]}


def test_task_rows_that_name_loops_need_them_mapped_in_conversation_mode(tmp_path):
    from actors.config import load_train_config

    data = _task_file(tmp_path, "retry", "retry")
    base = {"env": {"name": "math_tool", "kwargs": {"data": data, "split": "all"}}, "memory": {"name": "none"},
            "policy": {"max_model_len": 2048}}
    with pytest.raises(ValueError, match=r"name agent loops \['retry'\] .* set rollout.agent_loop to 'conversation'"):
        load_train_config(base)
    with pytest.raises(ValueError, match=r"\['retry'\] that rollout.agent_loops does not map; mapped: \['tool_agent'\]"):
        load_train_config({**base, "rollout": {"agent_loop": "conversation"}})
    for loops, message in [({"retry": "step"}, "not 'step'"), ({"retry": "nope:Nope"}, r"agent_loops\['retry'\]: "
                                                                                        "cannot load agent loop")]:
        with pytest.raises(ValueError, match=message):
            load_train_config({**base, "rollout": {"agent_loop": "conversation", "agent_loops": loops}})
    cfg = load_train_config({**base, "rollout": {"agent_loop": "conversation",
                                                 "agent_loops": {"retry": "actors.agent_loops:FormatRetry"}}})
    assert cfg.agent_loop.named == (("retry", "actors.agent_loops:FormatRetry"),)
    assert cfg.agent_card().loop == cfg.agent_loop  # served and evaluated as trained


VERL_SYSTEM = ("You are a math expert. Use the calculator, then put your final answer in the format of "
               "`#### <answer>`.")


@pytest.mark.parametrize("own_system", [True, False])
def test_a_task_rows_own_messages_open_the_conversation_with_the_tools_as_its_template_takes_them(
        tokenizer, tmp_path, own_system):
    """`prompt: row`: the row's chat messages (verl's `prompt`) open the conversation, not the env's prompt. The tool
    schemas go to the template's `tools=` where it reads them, else into the system turn the hermes way; a row
    without a system message gets the reply format there too. The first prompt is the template's rendering of
    exactly that, and GSM8K's `#### N` answers."""
    import json

    from envs.math_tool import ROW_REPLY_FORMAT, hermes_tools_block

    user = {"role": "user", "content": "Mia has 40 pens and buys 2 more. How many pens does she have?"}
    row = {"prompt": [{"role": "system", "content": VERL_SYSTEM}, user] if own_system else [user],
           "reward_model": {"ground_truth": "42"}}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(row) + "\n")
    env = envs.make("math_tool", data=str(path), prompt="row", tools=["calculator"])
    generate = scripted(tokenizer, [REPLIES[0].replace("2 + 3", "40 + 2"), "So she has #### 42"])
    decide = policy_decider(tokenizer, generate, {"max_tokens": 256, "temperature": 1.0}, max_model_len=8192,
                            loop=AgentLoop("conversation", 4096))
    episode = asyncio.run(play(env, memory.make("none"), decide, seed=0))
    assert episode.won and len(episode.steps) == 2, [s.reply for s in episode.steps]

    native = chat_deltas(tokenizer).tool_messages == "native"
    schemas = env.tool_schemas()
    assert [s["function"]["name"] for s in schemas] == ["calculator"]
    system = [VERL_SYSTEM] if own_system else [ROW_REPLY_FORMAT]
    if not native:
        system.append(hermes_tools_block(schemas))
    prompt = tokenizer.decode(episode.conversation.prompt_ids)
    assert user["content"] in prompt and "Math with tools" not in prompt  # the row's words, not the env's prompt
    if native:
        assert "Tools you may call:" in prompt and prompt.count('"calculator"') == 1  # once, by the template
    else:
        assert json.dumps(schemas[0]) in prompt and "<tool_call>" in prompt
    first = [{"role": "system", "content": "\n\n".join(system)}, user]
    expected = tokenizer.apply_chat_template(first, tools=schemas if native else None, add_generation_prompt=True,
                                             tokenize=False)
    assert episode.conversation.prompt_ids == tokenizer.encode(expected, add_special_tokens=False)


def test_the_rows_prompt_is_refused_by_name_when_misspelt():
    with pytest.raises(ValueError, match=r"prompt 'rows' not allowed; allowed: \['env', 'row'\]"):
        envs.make("math_tool", prompt="rows")
