"""Find environments by name, or by import path ``"package.module:Class"`` for envs that live outside raygent."""

from __future__ import annotations

import importlib
from typing import Any

from envs.base import TextEnv

# Entry points are import-path strings so that `import envs` stays light: a module loads when first made.
_REGISTRY: dict[str, str | type[TextEnv]] = {
    "alfworld": "envs.alfworld_env:AlfWorld",
    "blackjack": "envs.gym_cards:Blackjack",
    "ezpoints": "envs.gym_cards:EZPoints",
    "math_tool": "envs.math_tool:MathTool",
    "numberline": "envs.gym_cards:NumberLine",
    "points24": "envs.gym_cards:Points24",
    "search": "envs.search:SearchEnv",
    "sokoban": "envs.sokoban:Sokoban",
    "treasure_hunt": "envs.treasure_hunt:TreasureHunt",
    "webshop": "envs.webshop:WebShop",
}


def list_envs() -> list[str]:
    """Sorted names of the registered environments."""
    return sorted(_REGISTRY)


def register(name: str, entry_point: str | type[TextEnv]) -> None:
    """Make `make(name)` build `entry_point` (a TextEnv subclass or its ``"package.module:Class"`` path).

    Re-registering a name with the same entry point is a no-op; a different one raises ValueError, so two
    plugins cannot silently shadow each other.
    """
    if name in _REGISTRY and _REGISTRY[name] != entry_point:
        raise ValueError(f"environment {name!r} is already registered as {_REGISTRY[name]!r}")
    _REGISTRY[name] = entry_point


# Prompt pieces any env takes as keyword arguments of `make`, overriding its class-level defaults, so that a config
# can restyle a prompt without subclassing (e.g. a compact prompt for a small model).
PROMPT_KWARGS = ("task_description", "prompt_template", "memory_template")


def make(name_or_import_path: str, **kwargs: Any) -> TextEnv:
    """Build an environment from a registered name or a ``"package.module:Class"`` path, passing `kwargs`.

    `task_description`, `prompt_template` and `memory_template` (format strings with the fields of
    `TextEnv.build_prompt`) override the env's prompt pieces."""
    prompt = {k: kwargs.pop(k) for k in PROMPT_KWARGS if k in kwargs}
    entry = _REGISTRY.get(name_or_import_path)
    if entry is None:
        if ":" not in name_or_import_path:
            raise ValueError(
                f"unknown environment {name_or_import_path!r}; known: {', '.join(list_envs())}; "
                "or give an import path such as 'my_package.my_module:MyEnv'"
            )
        entry = name_or_import_path
    cls = _load(entry) if isinstance(entry, str) else entry
    if not (isinstance(cls, type) and issubclass(cls, TextEnv)):
        raise ValueError(f"{entry!r} is not a TextEnv subclass")
    env = cls(**kwargs)
    for key, value in prompt.items():
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {type(value).__name__}")
        setattr(env, key, value)
    if "prompt_template" in prompt:
        try:  # a template with an unknown field fails here, not at the first step
            env.prompt_template.format(task="", memory="", observation="", actions="", example="")
        except (KeyError, IndexError) as err:
            raise ValueError(f"prompt_template uses an unknown field {err}; allowed: task, memory, observation, "
                             "actions, example") from None
    return env


def _load(import_path: str) -> Any:
    module_name, _, attr = import_path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"bad import path {import_path!r}; expected 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} of {import_path!r}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from err
