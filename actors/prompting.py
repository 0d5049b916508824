"""How an env observation becomes the policy's input, in one place: training rollouts and the agent endpoint both
call this, so a served agent sees prompts built exactly as in training."""

from __future__ import annotations

from typing import Any


def agent_messages(env: Any, observation: str, memory_text: str) -> list[dict[str, str]]:
    """The chat the policy answers: one user turn with the env's prompt (task, memory, observation, actions, format)."""
    return [{"role": "user", "content": env.build_prompt(observation, memory_text)}]
