"""The gateway (actors/gateway.py) without Ray: a user's agent calls the real OpenAI-compatible server (uvicorn on
loopback, the `openai` client and raw HTTP), a scripted generate stands in for the Policy. What is recorded is what
the engine returned; calls that extend the history merge into the row conversation mode makes of the same turns;
rewritten histories make rows of their own, counted; hung and failing agents end at their deadline; concurrent
trajectories never mix; bad requests are 4xx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pyarrow as pa
import pytest
from transformers import AutoTokenizer

from actors.batch import conversation_rows
from actors.conversation import chat_deltas, next_turn
from actors.env_group import records_table
from actors.gateway import AgentTrajectory, Gateway, play_agent
from examples.calculator_agent import CALCULATOR
from tests.conftest import load_tokenizer

TASK = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "reward_model": {"ground_truth": "5"}}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'


@pytest.fixture(scope="module", params=["default:tiny", "smollm2-135m", "smollm2-135m+tools"])
def tokenizer(request):
    return load_tokenizer(request.param)  # +tools: a template that reads `tools=` (tool turns natively)


def scripted(tokenizer, replies):
    """The engine's stand-in: `replies` in order (their tokens + EOS), log-probs that name the call and token."""
    script = iter(replies)
    calls: list[list[int]] = []

    async def generate(prompt, sampling):
        text = next(script)
        ids = (tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])[:sampling["max_tokens"]]
        calls.append(list(prompt))
        return {"text": text, "token_ids": ids, "logprobs": [-(len(calls) + k / 100) for k in range(len(ids))],
                "finish_reason": "stop", "weight_version": 7, "replica_id": "r0"}

    generate.calls = calls
    return generate


def trajectory(tokenizer, replies, budget=2048):
    return AgentTrajectory(tokenizer, scripted(tokenizer, replies), {"max_tokens": 64, "temperature": 1.0},
                           budget=budget, max_model_len=4096, sampling_seed=11)


def run_agent(agent, trajectories, timeout_s=30.0):
    """Each trajectory played by `agent(task, llm)` through one gateway, all at once; their episodes."""

    async def main():
        gateway = Gateway()
        await gateway.start()
        return await asyncio.gather(*(play_agent(gateway, agent, None, t, TASK, seed=i, timeout_s=timeout_s)
                                      for i, t in enumerate(trajectories)))

    return asyncio.run(main())


async def react(task, llm):
    """Three calls: two calculator calls answered by tool messages, then the answer (the openai client)."""
    client = llm.client()
    messages = [*task["prompt"]]
    for _ in range(3):
        reply = (await client.chat.completions.create(model=llm.model, messages=messages,
                                                      tools=[CALCULATOR])).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    return 1.0 if "<answer>5</answer>" in (reply.content or "") else 0.0


def test_a_three_call_trajectory_records_the_engines_ids_and_merges_into_the_conversation_mode_row(tokenizer):
    t = trajectory(tokenizer, [CALL, CALL, "<answer>5</answer>"])
    (episode,) = run_agent(react, [t])
    assert episode.ended == "terminated" and episode.won and episode.return_ == 1.0
    assert len(episode.steps) == 3 and len(episode.segments) == 1
    c = episode.segments[0]
    engine = [s.response_ids for s in episode.steps]
    assert [c.response_ids[a:b] for a, b in c.turns] == engine  # the engine's ids, as returned
    assert [s.logprobs for s in episode.steps] == [c.logprobs[a:b] for a, b in c.turns]
    assert sum(c.loss_mask) == sum(map(len, engine)) and all(c.loss_mask[a:b] == [1] * (b - a) for a, b in c.turns)
    # every call's prompt was the token list so far: the recorded history, never the re-rendered text
    assert [t.generate.calls[k] for k in (1, 2)] == [c.ids[:len(c.prompt_ids) + c.turns[k][0]] for k in (1, 2)]

    # conversation mode's row of the same turns: the first prompt, then each reply and each tool result's delta
    chat = chat_deltas(tokenizer)
    from actors.tool_chat import encode_tool_chat

    first, _ = encode_tool_chat(tokenizer, TASK["prompt"], [CALCULATOR])
    reference, _ = next_turn(chat, None, TASK["prompt"], budget=2048, reply_tokens=64, max_model_len=4096)
    reference.prompt_ids = first
    for k, ids in enumerate(engine):
        if k:
            next_turn(chat, reference, [{"role": "tool", "content": "5"}], budget=2048, reply_tokens=64,
                      max_model_len=4096)
        reference.add_reply(ids, c.logprobs[c.turns[k][0]:c.turns[k][1]], 7)
    assert (c.prompt_ids, c.response_ids, c.loss_mask) == (reference.prompt_ids, reference.response_ids,
                                                           reference.loss_mask)

    # the batch's row: one per trajectory, the reward on it, every call's anchor
    turns = records_table([episode], group_id=0, group_size=1)
    turns = turns.append_column("advantage", pa.array([0.5] * turns.num_rows, pa.float32()))
    row = conversation_rows(turns).to_pylist()
    assert len(row) == 1 and row[0]["response_ids"] == c.response_ids and row[0]["turns"] == 3
    assert row[0]["reward"] == 1.0 and len(set(row[0]["turn_anchors"])) == 2  # the task, then "5" answered twice


def test_an_agent_that_resends_its_history_still_merges_and_one_that_rewrites_makes_rows_of_its_own(tokenizer):
    async def keeps_json(task, llm):  # stores the replies as the JSON it got (tool calls with their ids)
        messages = [*task["prompt"]]
        async with httpx.AsyncClient(base_url=llm.base_url, timeout=30) as http:
            for _ in range(2):
                body = (await http.post("/chat/completions", json={"messages": messages, "tools": [CALCULATOR]}))
                message = body.json()["choices"][0]["message"]
                messages += [message, *({"role": "tool", "tool_call_id": c["id"], "content": "5"}
                                        for c in message.get("tool_calls") or [])]
        return 0.0

    async def rewrites(task, llm):  # summarises its history before each call
        client = llm.client()
        for turn in range(3):
            history = [{"role": "user", "content": f"Summary of {turn} earlier turns. {task['prompt'][0]['content']}"}]
            await client.chat.completions.create(model=llm.model, messages=history)
        return 0.0

    # re-rendered, the first reply would read '<tool_call>{"name": ..., "arguments": {...}}</tool_call>' in the
    # template's own spelling; merged, the second prompt holds the engine's tokens of it
    kept_traj = trajectory(tokenizer, ["thinking  " + CALL.replace('": ', '":'), "more"])
    (kept,) = run_agent(keeps_json, [kept_traj])
    assert len(kept.steps) == 2 and len(kept.segments) == 1 and not kept_traj.splits
    second_prompt = kept_traj.generate.calls[1]
    first = kept.steps[0].response_ids
    assert second_prompt[len(kept.steps[0].prompt_ids):][:len(first)] == first
    rewritten_traj = trajectory(tokenizer, ["a", "b", "c"])
    (rewritten,) = run_agent(rewrites, [rewritten_traj])
    assert len(rewritten.segments) == 3 and rewritten_traj.splits == {"history_rewritten": 2}
    assert rewritten.final_info["gateway_rows"] == 3
    turns = records_table([kept, rewritten], group_id=0, group_size=2)
    turns = turns.append_column("advantage", pa.array([0.0] * turns.num_rows, pa.float32()))
    rows = conversation_rows(turns).to_pylist()
    assert [(r["traj_id"], r["turns"]) for r in rows] == [(0, 2), (1, 1), (1, 1), (1, 1)]
    assert [r["response_ids"] for r in rows[1:]] == [s.response_ids for s in rewritten.steps]


def test_hung_and_failing_agents_end_at_their_deadline_and_the_others_finish(tokenizer):
    async def hangs(task, llm):
        await llm.client().chat.completions.create(model=llm.model, messages=task["prompt"])
        await asyncio.sleep(3600)

    def hangs_in_sync_code(task, llm):  # blocking code: run in a thread, the actor's loop goes on
        llm.sync_client().chat.completions.create(model=llm.model, messages=task["prompt"])
        time.sleep(3)
        return 1.0

    def raises(task, llm):
        raise KeyError("no such field")

    async def silent(task, llm):
        return 1.0

    async def one_call(task, llm):
        await llm.client().chat.completions.create(model=llm.model, messages=task["prompt"])
        return {"reward": 0.5, "won": True}

    agents = {"hangs": hangs, "sync": hangs_in_sync_code, "raises": raises, "silent": silent, "ok": one_call}

    async def main():
        gateway = Gateway()
        await gateway.start()
        trajectories = [trajectory(tokenizer, ["x"]) for _ in agents]
        episodes = await asyncio.gather(*(play_agent(gateway, agent, None, t, TASK, seed=0, timeout_s=1.5)
                                          for t, agent in zip(trajectories, agents.values(), strict=True)))
        return dict(zip(agents, episodes, strict=True)), gateway

    episodes, gateway = asyncio.run(main())
    assert {k: e.ended for k, e in episodes.items()} == {"hangs": "agent_timeout", "sync": "agent_timeout",
                                                         "raises": "agent_error", "silent": "no_calls",
                                                         "ok": "terminated"}
    assert "KeyError" in episodes["raises"].final_info["agent_error"]
    # a failed trajectory keeps its calls, scored 0 with its last call invalid; the good one keeps its reward
    assert [(s.reward, s.valid) for s in episodes["hangs"].steps] == [(0.0, False)]
    assert episodes["ok"].won and episodes["ok"].return_ == 0.5 and not episodes["silent"].steps
    assert not gateway.trajectories  # every trajectory closed: a late call of the hung agent is refused


def test_concurrent_trajectories_never_mix_their_calls(tokenizer):
    async def numbered(task, llm):
        client = llm.client()
        messages = [{"role": "user", "content": f"trajectory {task['n']}"}]
        for _ in range(3):
            reply = (await client.chat.completions.create(model=llm.model, messages=messages)).choices[0].message
            messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": f"again {task['n']}"}]
            await asyncio.sleep(0)
        return 0.0

    async def main():
        gateway = Gateway()
        await gateway.start()
        trajectories = [trajectory(tokenizer, [f"reply of {n}"] * 3) for n in range(6)]
        return await asyncio.gather(*(play_agent(gateway, numbered, None, t, {**TASK, "n": n}, seed=n,
                                                 timeout_s=30) for n, t in enumerate(trajectories)))

    for n, episode in enumerate(asyncio.run(main())):
        assert len(episode.segments) == 1 and len(episode.steps) == 3
        text = tokenizer.decode(episode.segments[0].ids)
        assert f"trajectory {n}" in text and f"again {n}" in text and text.count("reply of") == 3
        assert all(f"reply of {n}" in s.reply for s in episode.steps)
        assert not any(f"trajectory {m}" in text for m in range(6) if m != n)


def test_the_openai_client_gets_tool_calls_streamed_and_not_and_bad_requests_are_4xx(tokenizer):
    seen = {}

    async def agent(task, llm):
        client = llm.client()
        plain = await client.chat.completions.create(model="anything", messages=task["prompt"], tools=[CALCULATOR])
        seen["calls"] = plain.choices[0].message.tool_calls
        seen["finish"] = plain.choices[0].finish_reason
        chunks = [c async for c in await client.chat.completions.create(
            model=llm.model, messages=task["prompt"], tools=[CALCULATOR], stream=True)]
        seen["streamed"] = [tc.function.name for c in chunks for tc in (c.choices[0].delta.tool_calls or [])
                            if c.choices]
        async with httpx.AsyncClient(base_url=llm.base_url, timeout=30) as http:
            seen["n"] = (await http.post("/chat/completions", json={"messages": task["prompt"], "n": 2}))
            seen["bad"] = (await http.post("/chat/completions", json={"messages": [{"role": "user"}]}))
            seen["other"] = (await http.get(llm.base_url.replace("/t/", "/t/x") + "/models"))
        return 1.0

    (episode,) = run_agent(agent, [trajectory(tokenizer, [CALL, CALL])])
    assert episode.ended == "terminated" and len(episode.steps) == 2
    assert [c.function.name for c in seen["calls"]] == ["calculator"] and seen["finish"] == "tool_calls"
    assert json.loads(seen["calls"][0].function.arguments) == {"expression": "2 + 3"}
    assert seen["streamed"] == ["calculator"]
    assert seen["n"].status_code == 400 and "n must be 1" in seen["n"].json()["error"]["message"]
    assert seen["bad"].status_code == 400 and "needs content" in seen["bad"].json()["error"]["message"]
    assert seen["other"].status_code == 404


@pytest.mark.parametrize("example", ["calculator_agent", "langgraph_agent", "agents_sdk_agent"])
def test_each_example_agent_runs_unchanged_through_the_gateway_and_its_calls_merge(example):
    """The examples as their users wrote them (the `openai` client, LangGraph, the Agents SDK): a tool call, its
    result, the answer. However each framework stores and re-sends its history, the second call extends the first
    (one row, the engine's tokens), and the reward is the example's own grading."""
    import importlib

    from app.default_model import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    run = importlib.import_module(f"examples.{example}").run
    t = trajectory(tokenizer, [CALL, "It is <answer>5</answer>"])
    (episode,) = run_agent(run, [t])
    assert episode.ended == "terminated", episode.final_info
    assert len(episode.steps) == 2 and len(episode.segments) == 1 and not t.splits, (t.splits, t.last_messages)
    assert episode.return_ == 1.0 and episode.won
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(episode.segments[0].response_ids)


def test_completion_calls_that_extend_their_text_merge_and_others_start_a_row(tokenizer):
    async def writer(task, llm):
        client, text = llm.client(), "Q: 2 + 3?\nA:"
        for _ in range(2):
            reply = await client.completions.create(model=llm.model, prompt=text, max_tokens=8)
            text += reply.choices[0].text + "\nQ: and again?\nA:"  # its own reply, then more text
        chunks = [c async for c in await client.completions.create(model=llm.model, prompt="New start:",
                                                                    stream=True)]
        return float("".join(c.choices[0].text for c in chunks) == "5")

    t = trajectory(tokenizer, [" 5", " 5", "5"])
    (episode,) = run_agent(writer, [t])
    assert episode.ended == "terminated" and episode.won and len(episode.steps) == 3
    assert len(episode.segments) == 2 and t.splits == {"history_rewritten": 1}
    merged = episode.segments[0]
    assert [merged.response_ids[a:b] for a, b in merged.turns] == [s.response_ids for s in episode.steps[:2]]
    assert t.generate.calls[1] == merged.ids[:len(merged.prompt_ids) + merged.turns[1][0]]


RESPONSES_TOOL = {"type": "function", **CALCULATOR["function"]}  # the Responses API's flat function tool


def test_responses_calls_merge_as_chat_calls_streamed_or_not_and_bad_items_are_4xx(tokenizer):
    """`/v1/responses` with the `openai` client: a function_call item comes back with its call id; the next call
    re-sends the items with the tool's output (and the one after names `previous_response_id` instead), streamed
    the last time; all three merge into one row, as the same chat calls do. Items and tools the gateway cannot
    read, and an unknown previous response, are 4xx naming what is wrong."""
    seen = {}

    async def agent(task, llm):
        client = llm.client()
        items = [{"role": "user", "content": task["prompt"][0]["content"]}]
        first = await client.responses.create(model=llm.model, instructions="Use the calculator.", input=items,
                                              tools=[RESPONSES_TOOL])
        (call,) = first.output
        seen["first"] = call
        items += [call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                       "output": "5"}]
        second = await client.responses.create(model=llm.model, instructions="Use the calculator.", input=items,
                                               tools=[RESPONSES_TOOL])
        (again,) = second.output
        events = [e async for e in await client.responses.create(
            model=llm.model, instructions="Use the calculator.", previous_response_id=second.id, tools=[RESPONSES_TOOL],
            input=[{"type": "function_call_output", "call_id": again.call_id, "output": "5"}], stream=True)]
        seen["events"] = [e.type for e in events]
        seen["final"] = events[-1].response
        async with httpx.AsyncClient(base_url=llm.base_url, timeout=30) as http:
            seen["image"] = await http.post("/responses", json={"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": "x"}]}]})
            seen["hosted"] = await http.post("/responses", json={"input": "hi", "tools": [{"type": "web_search"}]})
            seen["unknown"] = await http.post("/responses", json={"input": "hi", "previous_response_id": "resp_x"})
        return 1.0

    t = trajectory(tokenizer, [CALL, CALL, "It is <answer>5</answer>"])
    (episode,) = run_agent(agent, [t])
    assert episode.ended == "terminated" and len(episode.steps) == 3
    assert len(episode.segments) == 1 and not t.splits, (t.splits, t.last_messages)
    first = seen["first"]
    assert first.type == "function_call" and first.name == "calculator" and first.call_id.startswith("call_")
    assert json.loads(first.arguments) == {"expression": "2 + 3"}
    assert seen["events"][0] == "response.created" and seen["events"][-1] == "response.completed"
    assert "response.output_text.delta" in seen["events"]
    assert seen["final"].output_text == "It is <answer>5</answer>" and seen["final"].usage.output_tokens > 0
    c = episode.segments[0]
    assert [c.response_ids[a:b] for a, b in c.turns] == [s.response_ids for s in episode.steps]
    assert seen["image"].status_code == 400 and "input[0].content[0].type: 'input_image'" in \
        seen["image"].json()["error"]["message"]
    assert seen["hosted"].status_code == 400 and "tools[0].type: 'web_search'" in seen["hosted"].json()["error"][
        "message"]
    assert seen["unknown"].status_code == 404 and "resp_x" in seen["unknown"].json()["error"]["message"]


def test_a_config_that_cannot_play_a_users_agent_fails_naming_the_field():
    import yaml

    from actors.config import load_train_config
    from tests.conftest import REPO

    args = yaml.safe_load((REPO / "serve_configs" / "gateway_calculator_cpu.yaml").read_text())["applications"][0]
    args = args["args"]
    assert load_train_config(args).agent_loop.kind == "conversation"  # its calls make conversation rows
    wrong = {
        "examples.calculator_agent:nowhere": {"agent": {"entrypoint": "examples.calculator_agent:nowhere"}},
        "must take 2 arguments": {"agent": {"entrypoint": "examples.calculator_agent:final_answer"}},
        "memory.name must be 'none'": {"memory": {"name": "simple"}},
        "warm_start.enabled must be false": {"warm_start": {"enabled": True}},
        "are two agents": {"rollout": {**args["rollout"], "agent_loop": "actors.agent_loops:FormatRetry"}},
    }
    for message, change in wrong.items():
        with pytest.raises(ValueError) as e:
            load_train_config({**args, **change})
        assert message in str(e.value) and "invalid training config" in str(e.value), str(e.value)
