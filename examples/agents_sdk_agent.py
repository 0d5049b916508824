"""An OpenAI Agents SDK agent with the calculator as a function tool, as an Agents SDK user writes one. It speaks
the SDK's default API, Responses (`OpenAIResponsesModel`), through the client raygent gives it (`llm.client()`: the
trajectory's gateway during training; an `AsyncOpenAI` pointed at the agent endpoint's `/v1` when serving;
docs/gateway.md). Both servers take `/v1/responses`; the SDK's chat-completions model class
(`OpenAIChatCompletionsModel`) works the same way. Tracing is off: it would export each run to OpenAI's servers.
"""

from __future__ import annotations

from typing import Any

from examples.calculator_agent import MAX_TURNS, SYSTEM, calculate, final_answer


async def run(task: dict[str, Any], llm: Any) -> float:
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelBehaviorError,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression (+, -, *, /, parentheses)."""
        return calculate(expression)

    agent = Agent(name="calculator agent", instructions=SYSTEM, tools=[calculator],
                  model=OpenAIResponsesModel(model=llm.model, openai_client=llm.client()),
                  model_settings=ModelSettings(max_tokens=96))
    question = "\n".join(m["content"] for m in task["prompt"] if m["role"] == "user")
    try:
        result = await Runner.run(agent, question, max_turns=MAX_TURNS)
    except MaxTurnsExceeded:  # never answered within MAX_TURNS: no answer
        return 0.0
    except ModelBehaviorError:  # a reply the SDK refuses, e.g. cut at max_output_tokens (status "incomplete")
        return 0.0
    answer = final_answer(str(result.final_output))
    return float(answer is not None and answer == float(task["reward_model"]["ground_truth"]))
