"""The built-in memory modules. Each is small; all keep O(1) state in the episode length."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from memory.base import StepEntry


class NoMemory:
    """Shows nothing: for fully observable tasks (e.g. Sokoban, whose grid is the whole state)."""

    def reset(self) -> None:
        pass

    def store(self, observation: str, action: str | None, reward: float, info: dict[str, Any]) -> None:
        pass

    def render(self) -> str:
        return ""


class SimpleMemory:
    """The last `k` steps: observation and action (the paper's "history length 2" default)."""

    def __init__(self, k: int = 2, show_observations: bool = True):
        if k < 0:
            raise ValueError(f"SimpleMemory: k must be >= 0, got {k}")
        self.k = k
        self.show_observations = show_observations
        self.reset()

    def reset(self) -> None:
        self._steps: deque[StepEntry] = deque(maxlen=self.k)
        self._count = 0

    def store(self, observation: str, action: str | None, reward: float, info: dict[str, Any]) -> None:
        self._count += 1
        if self.k:
            self._steps.append(StepEntry(self._count, observation, action, float(reward)))

    def render(self) -> str:
        return "\n".join(step.format(self.show_observations) for step in self._steps)


def _char_count(text: str) -> int:
    return len(text)


def _tokenizer_counter(tokenizer: Any) -> Callable[[str], int]:
    """A token counter from a tokenizer object or a Hugging Face folder / hub id (imported lazily: memory stays light)."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


class SlidingWindowMemory:
    """As many of the most recent steps as fit a budget of characters, or of tokens when a tokenizer is given.

    The newest step always wins: older steps are dropped first, and a single step longer than the whole budget is cut
    from its start (its end, the action, is what matters most).
    """

    def __init__(self, max_chars: int = 1024, max_tokens: int | None = None, tokenizer: Any = None,
                 show_observations: bool = True):
        if max_tokens is not None and tokenizer is None:
            raise ValueError("SlidingWindowMemory: max_tokens needs a tokenizer (an object or a model folder / id)")
        self.budget = max_tokens if max_tokens is not None else max_chars
        if self.budget <= 0:
            raise ValueError(f"SlidingWindowMemory: the budget must be > 0, got {self.budget}")
        self.count = _tokenizer_counter(tokenizer) if max_tokens is not None else _char_count
        self.show_observations = show_observations
        self.reset()

    def reset(self) -> None:
        self._texts: deque[tuple[str, int]] = deque()
        self._used = 0
        self._steps = 0

    def store(self, observation: str, action: str | None, reward: float, info: dict[str, Any]) -> None:
        self._steps += 1
        text = StepEntry(self._steps, observation, action, float(reward)).format(self.show_observations)
        cost = self.count(text) + 1  # +1: the joining newline
        self._texts.append((text, cost))
        self._used += cost
        while self._used > self.budget and len(self._texts) > 1:
            self._used -= self._texts.popleft()[1]

    def render(self) -> str:
        if not self._texts:
            return ""
        text = "\n".join(t for t, _ in self._texts)
        if self._used > self.budget and self.count is _char_count:
            text = text[-self.budget:]
        return text


class KeyEventMemory:
    """Milestones the env marks in `info["key_event"]` (kept for the whole episode, newest `max_events`), plus the
    last `k` steps. Long tasks keep what mattered (a box placed, an item picked up) without keeping everything."""

    def __init__(self, k: int = 2, max_events: int = 8, show_observations: bool = False):
        self.k = k
        self.max_events = max_events
        self.recent = SimpleMemory(k, show_observations=show_observations)
        self.reset()

    def reset(self) -> None:
        self.recent.reset()
        self._events: deque[str] = deque(maxlen=self.max_events)
        self._steps = 0

    def store(self, observation: str, action: str | None, reward: float, info: dict[str, Any]) -> None:
        self._steps += 1
        event = info.get("key_event")
        if event:
            self._events.append(f"Step {self._steps}: {event}")
        self.recent.store(observation, action, reward, info)

    def render(self) -> str:
        parts = []
        if self._events:
            parts.append("Key events:\n" + "\n".join(self._events))
        recent = self.recent.render()
        if recent:
            parts.append("Last steps:\n" + recent)
        return "\n".join(parts)


class SearchMemory:
    """Past search queries and what came back (Search-R1 style agents).

    Reads `info["query"]` and `info["results"]` (a string or a list of passages) as the search env provides them;
    without them the action is taken as the query. Each result is cut to `max_result_chars`; the newest
    `max_queries` stay.
    """

    def __init__(self, max_queries: int = 4, max_result_chars: int = 400):
        self.max_queries = max_queries
        self.max_result_chars = max_result_chars
        self.reset()

    def reset(self) -> None:
        self._queries: deque[tuple[str, str]] = deque(maxlen=self.max_queries)

    def store(self, observation: str, action: str | None, reward: float, info: dict[str, Any]) -> None:
        query = info.get("query", action)
        if not query:
            return
        results = info.get("results", "")
        if not isinstance(results, str):
            results = "\n".join(map(str, results))
        self._queries.append((str(query), results[: self.max_result_chars]))

    def render(self) -> str:
        return "\n".join(f"Query: {q}\nResults:\n{r}" for q, r in self._queries)
