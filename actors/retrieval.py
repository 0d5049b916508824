"""The search env's retriever over the Retriever deployment (`app/retriever.py`), awaited: an env-group actor or the
agent endpoint runs many episodes in one event loop, so a search must never block it (no `.result()`)."""

from __future__ import annotations

import asyncio
from typing import Any

REMOTE = "serve"  # env.kwargs.retriever value that asks for the deployment


class HandleRetriever:
    """``asearch(queries, k)`` through a DeploymentHandle, with a deadline; the env's `astep` awaits it."""

    def __init__(self, handle: Any, timeout_s: float = 30.0):
        self.handle, self.timeout_s = handle, timeout_s

    async def asearch(self, queries: list[str], k: int) -> list[list[str]]:
        return await asyncio.wait_for(self.handle.search.remote(list(queries), k), self.timeout_s)

    def search(self, queries: list[str], k: int) -> list[list[str]]:
        raise RuntimeError("this retriever is remote and async: step the env with astep (the episode runner does)")


def attach_retriever(env: Any, kwargs: dict[str, Any], handle: Any) -> Any:
    """Give an env built with `retriever: serve` the deployment's client (other envs are returned as they are)."""
    if kwargs.get("retriever") == REMOTE and handle is not None and hasattr(env, "set_retriever"):
        env.set_retriever(HandleRetriever(handle))
    return env
