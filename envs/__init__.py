"""Gymnasium text environments for LLM agents: action parsing, prompt templates and group reset. No Ray here."""

from envs.base import CHARSET, Outcome, TextEnv, parse_action
from envs.groups import EnvGroups, group_seeds
from envs.registry import list_envs, make, register

__all__ = [
    "CHARSET",
    "EnvGroups",
    "Outcome",
    "TextEnv",
    "group_seeds",
    "list_envs",
    "make",
    "parse_action",
    "register",
]
