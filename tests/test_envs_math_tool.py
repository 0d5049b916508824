"""Tools (schemas, registry, retries, cache, the safe calculator) and the math_tool env."""

from __future__ import annotations

import json
from pathlib import Path

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


# ---- verl's tool YAML, per-sample kwargs, parallel calls -----------------------------------------------------------
VERL_TOOLS = Path(__file__).resolve().parent.parent / "examples" / "verl_tools.yaml"


def _price_tasks(tmp_path, prices: list[dict[str, float]]) -> str:
    """verl task rows whose extra_info.tools_kwargs give each task its own price list."""
    path = tmp_path / "priced.jsonl"
    path.write_text("".join(json.dumps({
        "prompt": [{"role": "user", "content": f"What do 3 apples cost? (task {i})"}],
        "reward_model": {"ground_truth": str(3 * p["apple"])},
        "extra_info": {"tools_kwargs": {"unit_price": {"create_kwargs": {"prices": p}}}}}) + "\n"
        for i, p in enumerate(prices)))
    return str(path)


def test_a_verl_tool_yaml_loads_verls_builtin_names_and_user_classes() -> None:
    """verl's GSM8K reward tool maps to raygent's AnswerCheck (verl is not installed); a user class loads by its
    dotted path; each tool's schema is the YAML's, as the chat template's `tools=` gets it."""
    import yaml

    from envs.tools import AnswerCheck, SessionTool, load_tools_config

    tools = load_tools_config(VERL_TOOLS)
    assert [t.name for t in tools] == ["calc_gsm8k_reward", "unit_price"]
    assert isinstance(tools[0].impl, AnswerCheck) and type(tools[1].impl).__name__ == "UnitPrice"
    declared = yaml.safe_load(VERL_TOOLS.read_text())["tools"]
    assert [t.schema() for t in tools] == [{**d["tool_schema"]} for d in declared]
    assert all(isinstance(t, SessionTool) and not t.cacheable for t in tools)
    assert tools[1].impl.currency == "coins"  # the YAML's config reached the class


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("tools: []", "needs 'tools'"),
    ("tools: [{config: {type: native}}]", r"tools\[0\]\.class_name: required"),
    ("tools: [{class_name: no.such.Tool}]", r"tools\[0\]\.class_name: cannot load 'no.such.Tool'"),
    ("tools: [{class_name: verl.tools.gsm8k_tool.Gsm8kTool, config: {type: mcp}}]",
     r"tools\[0\]\.config\.type: 'mcp' is not supported; allowed: 'native'"),
    ("tools: [{class_name: envs.tools.Search, tool_schema: {type: function, function: {name: s, parameters: "
     "{type: 5}}}}]", "not a JSON schema"),
    ("tools: [{class_name: envs.tools.CalculatorArgs}]",
     r"tools\[0\]: envs.tools.CalculatorArgs\(config, tool_schema\): ValidationError"),
])
def test_a_bad_tool_yaml_fails_at_config_time_naming_the_field(tmp_path, yaml_text, message) -> None:
    from pydantic import ValidationError

    from actors.config import TrainConfig

    path = tmp_path / "tools.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValidationError, match=message):
        TrainConfig.model_validate({"env": {"name": "math_tool", "kwargs": {"tools_config": str(path)}}})


def test_session_tools_get_each_tasks_kwargs_and_are_released(tmp_path) -> None:
    """One tool instance per episode, created with its task row's tools_kwargs (two tasks, two price lists: a call
    never answers with the other task's prices), released when the episode ends or is left for a new one;
    arguments that fail the YAML's JSON schema and a tool that raises are tool messages, not crashes."""
    data = _price_tasks(tmp_path, [{"apple": 2}, {"apple": 5, "pear": 1}])
    env = MathTool(data=data, split="all", tools=[], tools_config=str(VERL_TOOLS))
    unit_price = env.registry.tools["unit_price"].impl
    seen = {}
    for seed in range(12):
        env.reset(seed=seed)
        _, _, _, _, info = env.step(call("unit_price", item="apple", quantity=3))
        assert info["tool_outputs"] == [f"{env.problem.answer} coins"] and len(unit_price._prices) == 1
        seen[env.problem.answer] = True
        _, _, _, _, info = env.step(call("unit_price", item="apple", quantity=0))
        assert info["tool_error"] and "quantity: 0 is less than the minimum of 1" in info["tool_outputs"][0]
        _, _, _, _, info = env.step(call("unit_price", item="plum"))
        assert info["tool_error"] and "raised ValueError: no price for 'plum'" in info["tool_outputs"][0]
        if seed % 2:  # finish it: released at the end; else left for the next reset, released there
            _, reward, terminated, _, _ = env.step(f"<answer>{env.problem.answer}</answer>")
            assert terminated and reward == 1.0 and unit_price._prices == {}
    env.reset(seed=0)
    assert unit_price._prices == {} and set(seen) == {6, 15}


def test_verls_gsm8k_reward_tool_checks_the_generated_problems_answer() -> None:
    env = MathTool(tools=["calculator"], tools_config=str(VERL_TOOLS))
    env.reset(seed=3)
    _, _, _, _, info = env.step(call("calc_gsm8k_reward", answer=f"#### {env.problem.answer}"))
    assert info["tool_outputs"] == [f"answer {env.problem.answer} is correct"]
    _, _, _, _, info = env.step(call("calc_gsm8k_reward", answer=str(env.problem.answer + 1)))
    assert info["tool_outputs"] == [f"answer {env.problem.answer + 1} is not correct"]


class _Rendezvous:
    """A verl-interface tool whose calls finish only once `expected` of them are running at the same time (or fail
    after 10 s): two calls of one reply succeed only if they run concurrently. Answers in verl's other shapes (a
    (id, response) create, a {"text"} response with a step reward)."""

    def __init__(self, expected: int):
        import asyncio

        self.expected, self.running, self.all_in = expected, 0, asyncio.Event()

    async def create(self, instance_id=None, **_):
        return instance_id, None

    async def execute(self, instance_id, parameters, **_):
        import asyncio

        self.running += 1
        if self.running >= self.expected:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), 10)
        return {"text": f"echo {parameters['text']}"}, 0.25, {}


def test_the_calls_of_one_reply_run_concurrently_and_answer_in_order() -> None:
    """Two calls in one reply run at once (the rendezvous needs both in flight), their results come back in call
    order as two `tool` messages, and their step rewards add up; with the default limit of one call per reply the
    second is ignored."""
    import asyncio

    from envs.tools import FunctionToolSchema, SessionTool

    schema = FunctionToolSchema.model_validate({"type": "function", "function": {
        "name": "echo", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}})
    reply = call("echo", text="a") + "\n" + call("echo", text="b")
    with pytest.raises(ValueError, match="no async create"):
        SessionTool(object(), schema)
    env = MathTool(registry=ToolRegistry([SessionTool(_Rendezvous(2), schema)]), max_parallel_calls=2)
    env.reset(seed=1)
    _, reward, _, _, info = asyncio.run(env.astep(reply))
    assert info["is_action_valid"] and not info["tool_error"] and reward == 0.5
    assert env.followup_messages("", info) == [{"role": "tool", "content": "echo a"},
                                               {"role": "tool", "content": "echo b"}]
    single = MathTool(registry=ToolRegistry([SessionTool(_Rendezvous(1), schema)]))
    single.reset(seed=1)
    _, _, _, _, info = asyncio.run(single.astep(reply))
    assert info["action"] == call("echo", text="a") and info["tool_outputs"] == ["echo a"]


def test_a_cached_result_never_crosses_tasks_with_other_kwargs() -> None:
    """A pure tool's cache is keyed by the trajectory's kwargs for it too."""
    from envs.tools import ToolSession

    seen = []

    def lookup(key: str) -> str:
        seen.append(key)
        return f"value {len(seen)}"

    reg = ToolRegistry([tool(lookup)])
    first, second = ToolSession({"lookup": {"create_kwargs": {"table": 1}}}), ToolSession(
        {"lookup": {"create_kwargs": {"table": 2}}})
    assert reg.run(ToolCall("lookup", {"key": "k"}), first).output == "value 1"
    assert reg.run(ToolCall("lookup", {"key": "k"}), first).cached
    assert reg.run(ToolCall("lookup", {"key": "k"}), second).output == "value 2"
