"""A ReAct agent over the `openai` client with a calculator tool, as a user writes one: nothing in it is raygent's
but the two arguments of `run`. Trained with `serve run serve_configs/gateway_calculator_cpu.yaml`
(`agent.entrypoint: examples.calculator_agent:run`); served afterwards by the agent endpoint, where the same loop
runs against the trained policy with `base_url` pointing at `/v1` (docs/gateway.md).

To train your own agent the same way, change where its client points and return a reward:

    async def run(task, llm):                  # task: the env's task row; llm: the trajectory's endpoint
        client = llm.client()                  # = AsyncOpenAI(base_url=llm.base_url, api_key=...)
        ...                                    # your agent, unchanged
        return reward                          # a number (or {"reward": r, "won": bool})
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

SYSTEM = ("Solve the word problem. Call the calculator for any arithmetic, then give the final number as "
          "<answer>N</answer>.")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+, -, *, /, parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
MAX_TURNS = 4
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The tool: +, -, *, / and parentheses over numbers; anything else is an error message for the model."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"Error: {e}"
    return str(int(result)) if float(result).is_integer() else str(round(result, 6))


def final_answer(text: str | None) -> float | None:
    found = re.search(r"<answer>\s*(-?[\d,]*\.?\d+)\s*</answer>", text or "")
    return float(found.group(1).replace(",", "")) if found else None


NUDGE = "Call the calculator, or give the final number as <answer>N</answer>."


async def run(task: dict[str, Any], llm: Any) -> float:
    """One episode: the problem, then tool calls and their results until the model answers (at most MAX_TURNS
    calls; a reply with neither gets a reminder of the format); 1.0 when the answer is the task's ground truth."""
    client = llm.client()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, *task["prompt"]]
    reply = None
    for _ in range(MAX_TURNS):
        completion = await client.chat.completions.create(model=llm.model, messages=messages, tools=[CALCULATOR],
                                                          max_tokens=96)
        reply = completion.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            if final_answer(reply.content) is not None:
                break
            messages.append({"role": "user", "content": NUDGE})
        for call in reply.tool_calls or []:
            try:
                expression = json.loads(call.function.arguments or "{}").get("expression", "")
            except json.JSONDecodeError:
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    answer = final_answer(reply.content if reply is not None else None)
    return float(answer is not None and answer == float(task["reward_model"]["ground_truth"]))
