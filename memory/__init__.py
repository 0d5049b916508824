"""Memory modules: the bounded view of its past that the agent is shown in each prompt. No Ray here."""

from __future__ import annotations

import importlib
from typing import Any

from memory.base import Memory, StepEntry
from memory.modules import KeyEventMemory, NoMemory, SearchMemory, SimpleMemory, SlidingWindowMemory

MEMORIES: dict[str, type] = {
    "none": NoMemory,
    "simple": SimpleMemory,
    "sliding_window": SlidingWindowMemory,
    "key_event": KeyEventMemory,
    "search": SearchMemory,
}


def make(name_or_import_path: str, **kwargs: Any) -> Memory:
    """Build a memory module from a built-in name (see `MEMORIES`) or a "package.module:Class" import path."""
    if ":" in name_or_import_path:
        module_name, _, attr = name_or_import_path.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"memory {name_or_import_path!r} could not be imported: {e}") from e
    elif name_or_import_path in MEMORIES:
        cls = MEMORIES[name_or_import_path]
    else:
        raise ValueError(
            f"unknown memory {name_or_import_path!r}; allowed: {sorted(MEMORIES)} or 'package.module:Class'"
        )
    module = cls(**kwargs)
    if not isinstance(module, Memory):
        raise ValueError(f"memory {name_or_import_path!r} lacks reset/store/render")
    return module


__all__ = [
    "MEMORIES",
    "KeyEventMemory",
    "Memory",
    "NoMemory",
    "SearchMemory",
    "SimpleMemory",
    "SlidingWindowMemory",
    "StepEntry",
    "make",
]
