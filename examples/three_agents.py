"""The three example agents behind one entrypoint, the task's env seed choosing which plays it (`seed % 3`: the
`openai`-client loop, the LangGraph agent, the Agents SDK agent), so that one run trains all three. A group's
trajectories share their task, so each group is one agent's. The suite's gateway run uses it
(`tests/test_train_envs.py`)."""

from __future__ import annotations

from typing import Any

from examples import agents_sdk_agent, calculator_agent, langgraph_agent

AGENTS = (calculator_agent.run, langgraph_agent.run, agents_sdk_agent.run)


def agent_for(task: dict[str, Any]) -> Any:
    return AGENTS[int(task["extra_info"]["seed"]) % len(AGENTS)]


async def run(task: dict[str, Any], llm: Any) -> float:
    return await agent_for(task)(task, llm)
