"""The configuration reference (docs/configuration.md), generated from the pydantic schema so that it cannot drift
from what the apps accept: `python -m app.config_reference` rewrites it, and tests/test_docs.py fails when the
committed page is not what this renders."""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
BOUNDS = {"Ge": ">=", "Gt": ">", "Le": "<=", "Lt": "<"}


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a nested section (`PolicyConfig`, or `LoraConfig | None`), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    try:
        return f"`{json.dumps(value)}`"
    except TypeError:
        return f"`{value}`"


def _bounds(field: FieldInfo) -> str:
    names = {"Ge": "ge", "Gt": "gt", "Le": "le", "Lt": "lt"}  # annotated_types' bounds (slotted dataclasses)
    parts = [f"{BOUNDS[type(m).__name__]} {getattr(m, names[type(m).__name__])}" for m in field.metadata
             if type(m).__name__ in BOUNDS]
    pattern = next((getattr(m, "pattern", None) for m in field.metadata if getattr(m, "pattern", None)), None)
    return ", ".join(parts + ([f"matches `{pattern}`"] if pattern else []))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _tables(model: type[BaseModel], prefix: str, out: list[str], app: str = "") -> None:
    """One table of `model`'s own fields, then one per nested section (depth first); `app` names the app in the
    sections' headings where two apps share a section's name."""
    rows, sections = [], []
    for name, field in model.model_fields.items():
        nested = _section_model(field.annotation)
        if nested is not None:
            sections.append((f"{prefix}{name}", nested, field))
            continue
        kind = _type_name(field.annotation)
        bounds = _bounds(field)
        rows.append(f"| `{prefix}{name}` | {_cell(kind)}{f' ({bounds})' if bounds else ''} | {_default(field)} | "
                    f"{_cell(field.description or '')} |")
    if rows:
        out += ["| field | type | default | what it is |", "|---|---|---|---|", *rows, ""]
    for path, nested, field in sections:
        optional = type(None) in typing.get_args(field.annotation)
        out += [f"### {app}`{path}`", ""]
        about = " ".join(filter(None, [field.description, (nested.__doc__ or "").strip()]))
        if about:
            out += [_cell(about), ""]
        if optional:
            out += ["Optional: absent (null) unless set.", ""]
        _tables(nested, f"{path}.", out, app)


def render() -> str:
    """The page: the training app's args (`serve_configs/train.yaml`), then the agent app's (`agent.yaml`)."""
    from actors.config import TrainConfig
    from app.agent_http import AgentConfig

    out = ["# Configuration reference", "",
           "Generated from the config schema (`python -m app.config_reference`; the test suite fails when this page "
           "is out of date). Every field is checked before any actor starts: a bad value fails the run at once, "
           "naming its path and what is allowed.", "",
           "## The training app: `args` of `serve_configs/train.yaml`", "",
           "`serve run CONFIG` or `raygent train CONFIG` (`--set KEY=VALUE` changes one field). Sizes and "
           "resources of the deployments (`Policy`, `TrainingRun`) are Serve's own `deployments:` options.", ""]
    _tables(TrainConfig, "", out)
    out += ["## The agent app: `args` of `serve_configs/agent.yaml`", "",
            "`serve run serve_configs/agent.yaml`, or `serve run app.agent:build_agent_app model=DIR`.", ""]
    _tables(AgentConfig, "", out, app="agent: ")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    sys.stdout.write(f"wrote {PAGE}\n")
