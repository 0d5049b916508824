"""The memory protocol: what the agent is shown of its own past.

Step-independent rollout (GiGPO paper, Sec. 3): the prompt at step t is built from the current observation plus a
*bounded* summary of the past, so prompt length does not grow with the episode. A memory module is that summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Memory(Protocol):
    """What every memory module offers. `store` is called once per env step, `render` before each prompt."""

    def reset(self) -> None: ...

    def store(self, observation: str, action: str | None, reward: float, info: dict[str, Any]) -> None: ...

    def render(self) -> str: ...


@dataclass
class StepEntry:
    """One past step: the observation the agent acted on, the action it took (None = invalid reply), the reward."""

    index: int
    observation: str
    action: str | None
    reward: float
    info: dict[str, Any] = field(default_factory=dict)

    def format(self, show_observation: bool = True) -> str:
        action = self.action if self.action is not None else "(invalid reply)"
        head = f"Step {self.index}: action {action}, reward {self.reward:g}"
        return f"{head}\nObservation before it:\n{self.observation}" if show_observation else head
