"""A LangGraph ReAct agent (langgraph's prebuilt `create_react_agent` over `langchain-openai`'s ChatOpenAI) with the
calculator tool, as a LangGraph user writes one. The only raygent-specific line is the model's `base_url`: the
trajectory's gateway URL during training (`llm.base_url`), the agent endpoint's `/v1` when serving (docs/gateway.md).
"""

from __future__ import annotations

from typing import Any

from examples.calculator_agent import MAX_TURNS, SYSTEM, calculate, final_answer


async def run(task: dict[str, Any], llm: Any) -> float:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression (+, -, *, /, parentheses)."""
        return calculate(expression)

    model = ChatOpenAI(model=llm.model, base_url=llm.base_url, api_key=llm.api_key, max_tokens=96, max_retries=0)
    agent = create_react_agent(model, [calculator], prompt=SYSTEM)
    try:  # a model call and a tool step per turn, then the last answer
        state = await agent.ainvoke({"messages": task["prompt"]}, {"recursion_limit": 2 * MAX_TURNS})
    except GraphRecursionError:  # never answered within MAX_TURNS: no answer
        return 0.0
    answer = final_answer(state["messages"][-1].content)
    return float(answer is not None and answer == float(task["reward_model"]["ground_truth"]))
