"""Tools (schemas, registry, retries, cache, the safe calculator) and the math_tool env."""

from __future__ import annotations

import json

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

import envs
from envs.data.arithmetic import load_problems, parse_number
from envs.math_tool import MathTool
from envs.retrieval import BM25Retriever
from envs.tools import (
    CALCULATOR,
    Tool,
    ToolCall,
    ToolError,
    ToolRegistry,
    TransientToolError,
    calculate,
    find_tagged,
    load_tool,
    parse_call,
    render_call,
    retrieve_tool,
    tool,
)


def call(name: str, **arguments) -> str:
    return render_call(ToolCall(name, arguments))


# ---- calculator ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("expression", "value"), [
    ("1 + 2 * 3", 7), ("(12 + 5) * 3 / 4", 12.75), ("2 ** 10", 1024), ("2^3", 8), ("3 x 4", 12), ("1,000 * 2", 2000),
    ("-(4 - 10) // 4", 1), ("7 % 3", 1), ("10 / 4 * 2", 5), ("0.1 + 0.2", 0.3),
])
def test_calculator_arithmetic(expression: str, value: float) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", [
    "__import__('os').system('ls')", "().__class__", "(1).real", "x + 1", "open('f')", "[1, 2]", "lambda: 1",
    "9 ** 9 ** 9", "10 ** 100", "2 ** 1000000", "(10 ** 20) * (10 ** 20)", "1 / 0", "5 % 0", "True + 1", "'a' * 3",
    "(-8) ** 0.5", "1e400", "1 +", "1" * 300,
])
def test_calculator_refuses_unsafe_or_huge(expression: str) -> None:
    with pytest.raises(ToolError):
        calculate(expression)


# ---- registry -----------------------------------------------------------------------------------------------------
def test_schema_validation_errors_are_results_not_crashes() -> None:
    reg = ToolRegistry(["calculator"])
    assert reg.tools["calculator"].schema()["function"]["parameters"]["required"] == ["expression"]
    ok = reg.run('{"Name": "Calculator", "Arguments": {"Expression": "6 * 7"}}')
    assert ok.ok and ok.output == "42" and ok.call == ToolCall("calculator", {"expression": "6 * 7"})
    for text, message in [
        ('{"name": "calculator", "arguments": {"expr": "1"}}', "expression: Field required"),
        ('{"name": "calculator", "arguments": {"expression": 5}}', "expression: Input should be a valid string"),
        ('{"name": "calculator", "arguments": {"expression": "1/0"}}', "division by zero"),
        ('{"name": "shell", "arguments": {}}', "unknown tool 'shell'"),
        ('{"name": "calculator", "arguments": []}', '"arguments" must be a JSON object'),
        ("not json", "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
    ]:
        result = reg.run(text)
        assert not result.ok and message in result.output and result.output.startswith("Error:"), text


def test_retries_transient_errors_a_bounded_number_of_times_and_caches() -> None:
    calls = {"flaky": 0, "down": 0, "pure": 0}

    class Args(BaseModel):
        x: int

    def flaky(args: Args) -> int:
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            raise TransientToolError("busy")
        return args.x * 2

    def down(args: Args) -> int:
        calls["down"] += 1
        raise TimeoutError("no answer")

    def pure(args: Args) -> int:
        calls["pure"] += 1
        return args.x + 1

    reg = ToolRegistry([Tool("flaky", "", Args, flaky), Tool("down", "", Args, down), Tool("pure", "", Args, pure)],
                       max_retries=2, cache_size=2)
    result = reg.run(ToolCall("flaky", {"x": 4}))
    assert result.ok and result.output == "8" and result.attempts == 3
    result = reg.run(ToolCall("down", {"x": 1}))
    assert not result.ok and "after 3 attempts" in result.output and calls["down"] == 3
    for x in (1, 1, 2, 1, 3, 1):  # LRU of size 2: 1 stays cached while used; 2 and 3 push nothing useful out
        reg.run(ToolCall("pure", {"x": x}))
    assert calls["pure"] == 3 and reg.run(ToolCall("pure", {"x": 1})).cached


def test_tools_from_functions_and_import_paths() -> None:
    @tool
    def add(a: int, b: int = 1) -> int:
        """Add two integers."""
        return a + b

    assert add.name == "add" and add.description == "Add two integers." and "a: integer" in add.signature()
    reg = ToolRegistry([add, "envs.tools:CALCULATOR"])
    assert reg.run(ToolCall("add", {"a": 2})).output == "3"
    assert "Extra inputs" in reg.run(ToolCall("add", {"a": 2, "c": 1})).output
    assert load_tool("calculator") is CALCULATOR and load_tool("math:gcd").name == "gcd"
    with pytest.raises(ValueError, match="unknown tool"):
        load_tool("nope")
    with pytest.raises(ValueError, match="cannot load"):
        load_tool("envs.tools:missing")


def test_retrieve_tool_wraps_a_retriever() -> None:
    reg = ToolRegistry([retrieve_tool(BM25Retriever(["paris is in france", "rome is in italy"]))])
    result = reg.run(ToolCall("retrieve", {"query": "where is rome", "k": 1}))
    assert result.ok and result.output == "[1] rome is in italy"
    assert "k: Input should be less than or equal to 10" in reg.run(ToolCall("retrieve", {"query": "x", "k": 99})).output


def test_find_tagged_and_parse_call() -> None:
    assert find_tagged("a <ANSWER> 4 </answer> <tool_call>x</tool_call>", ("tool_call", "answer")) == ("answer", "4")
    assert find_tagged("<tool_call>unclosed", ("tool_call",)) is None
    assert parse_call('{"name": "f"}') == ToolCall("f", {})
    with pytest.raises(ToolError):
        parse_call('{"arguments": {}}')


# ---- the env ------------------------------------------------------------------------------------------------------
def test_check_env_and_registry() -> None:
    env = envs.make("math_tool")
    assert isinstance(env, MathTool)
    check_env(env.unwrapped, skip_render_check=True)


def test_tool_turns_then_answer() -> None:
    env = MathTool()
    obs, info = env.reset(seed=0)
    prompt = env.build_prompt(obs)
    assert "calculator(expression: string)" in prompt and "<answer>" in prompt
    obs, reward, terminated, _, info = env.step(call("calculator", expr="1"))  # schema error: an observation
    assert info["is_action_valid"] and info["tool_error"] and "expression: Field required" in obs and not terminated
    same, _, _, _, info = env.step("<tool_call>{oops</tool_call>")  # not JSON: invalid, nothing moves
    assert same == obs and not info["is_action_valid"]
    obs, _, _, _, info = env.step(env.expert_action())
    assert not info["tool_error"] and obs.endswith(f"Tool calculator returned: {env.problem.answer}")
    obs, reward, terminated, _, info = env.step(f"The answer is <answer>{env.problem.answer}</answer>")
    assert reward == 1.0 and terminated and info["won"]


def test_wrong_answer_and_no_number() -> None:
    env = MathTool()
    obs, _ = env.reset(seed=1)
    same, _, _, _, info = env.step("<answer>many</answer>")
    assert same == obs and not info["is_action_valid"]
    _, reward, terminated, _, info = env.step(f"<answer>{env.problem.answer + 1}</answer>")
    assert reward == 0.0 and terminated and not info["won"]


def test_expert_wins_many_seeds_and_is_deterministic() -> None:
    env = MathTool()
    for seed in range(100):
        env.reset(seed=seed)
        while True:
            _, reward, terminated, truncated, info = env.step(env.expert_action())
            if terminated or truncated:
                break
        assert info["won"] and reward == 1.0, seed
    first = {MathTool().reset(seed=s)[0] for s in range(10)}
    assert len(first) == 10 and MathTool().reset(seed=3) == MathTool().reset(seed=3)


def test_gsm8k_loader(tmp_path) -> None:
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "2 * 1200 = 2400\n#### 2,400"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    problems = load_problems(path)
    assert [p.answer for p in problems] == [7, 2400] and problems[0].expression == ""
    env = MathTool(data=str(path))
    obs, _ = env.reset(seed=0)
    assert env.problem in problems and obs == f"Question: {env.problem.question}"
    assert env.expert_action() == f"<answer>{env.problem.answer}</answer>"
    _, reward, *_ = env.step(f"<answer>{env.problem.answer:,}</answer>")
    assert reward == 1.0
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "no final line"}\n')
    with pytest.raises(ValueError, match="####"):
        load_problems(tmp_path / "bad.jsonl")
    assert parse_number("$1,234.50") == 1234.5 and parse_number("none") is None


_FRAGMENTS = ["<tool_call>", "</tool_call>", "<answer>", "</answer>", '{"name": "calculator", "arguments": {',
              '"expression": "', "9**9**9", "__import__('os')", '"}}', "1/0", "<action>", " ", "\n", "é", "{", "["]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.text(), st.lists(st.sampled_from(_FRAGMENTS), max_size=10).map("".join)), max_size=5))
def test_step_never_raises(replies: list[str]) -> None:
    env = MathTool()
    _, info = env.reset(seed=2)
    for reply in replies:
        anchor = info["anchor"]
        obs, reward, terminated, truncated, info = env.step(reply)
        assert obs in env.observation_space and isinstance(reward, float)
        if not info["is_action_valid"]:
            assert info["anchor"] == anchor
        if terminated or truncated:
            break


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_verl_task_file_of_the_generated_set_plays(tmp_path, suffix) -> None:
    """The generated problems written as verl task rows (chat prompt, reward_model.ground_truth, extra_info with
    the solving expression), read back from a local path and a file:// URI: the env plays them, its expert wins,
    and the train and test files share no problem."""
    from envs.data.arithmetic import read_rows, write_tasks

    train = write_tasks(tmp_path / f"train{suffix}", 40, "train")
    test = write_tasks(tmp_path / f"test{suffix}", 40, "test")
    rows = read_rows(train)
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["reward_model"]["ground_truth"].isdigit()
    problems = load_problems(train)
    assert problems == load_problems(f"file://{train}") and len(problems) == 40
    assert {p.question for p in problems}.isdisjoint({p.question for p in load_problems(test)})
    assert all(p.expression for p in problems)
    env = MathTool(data=str(train), split="all")
    obs, _ = env.reset(seed=5)
    assert obs == f"Question: {env.problem.question}"
    for _ in range(3):
        obs, reward, terminated, _, info = env.step(env.expert_action())
        if terminated:
            break
    assert terminated and reward == 1.0 and info["won"]
    bad = tmp_path / f"bad{suffix}"
    write_tasks(bad, 1)
    if suffix == ".jsonl":
        bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "q"}], "reward_model": {}}) + "\n")
        with pytest.raises(ValueError, match="ground_truth"):
            load_problems(bad)
