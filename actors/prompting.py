"""How an env observation becomes the policy's input, in one place: the episode runner (training rollouts,
validation, demonstrations, the agent endpoint) and the policy deployment's chat requests all call this, so a served
agent sees prompts built exactly as in training."""

from __future__ import annotations

from typing import Any


def agent_messages(env: Any, observation: str, memory_text: str) -> list[dict[str, str]]:
    """The chat the policy answers: one user turn with the env's prompt (task, memory, observation, actions, format)."""
    return [{"role": "user", "content": env.build_prompt(observation, memory_text)}]


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The one chat encoder: the model's chat template with the generation prompt, no extra special tokens."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_prompt(tokenizer: Any, env: Any, observation: str, memory_text: str) -> list[int]:
    """The prompt's token ids for one step of an episode."""
    return encode_chat(tokenizer, agent_messages(env, observation, memory_text))
