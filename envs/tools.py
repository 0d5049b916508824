"""Tool calling for text agents: tools declared with pydantic schemas, a registry, and a safe executor.

A tool is a name, a description and a pydantic model of its arguments (its JSON schema is what the model is shown).
The model calls one inside its reply as JSON::

    <tool_call>{"name": "calculator", "arguments": {"expression": "(12 + 3) * 4"}}</tool_call>

`ToolRegistry.run` validates the arguments against the schema before anything runs, retries transient failures a
bounded number of times, caches results (LRU), and turns every failure (bad JSON, unknown tool, schema error, an
exception inside the tool) into an error text for the next observation: a tool never crashes the episode.

Built-in tools: `calculator` (safe arithmetic on an `ast` whitelist, no `eval`) and `retrieve` (wraps a
`envs.retrieval.Retriever`). Others load by name or import path ``"package.module:function_or_class"``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import operator
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model


# ---- tagged replies ----------------------------------------------------------------------------------------------
def find_tagged(reply: str, tags: Iterable[str]) -> tuple[str, str] | None:
    """The first ``<tag>...</tag>`` in `reply` among `tags` (whichever opens first), as (tag, stripped inner text).

    Tags match case-insensitively (ASCII only). Like `envs.parse_action`, plain searches keep it linear in the reply
    length. Text around the tag, an ``<action>`` wrapper included, is ignored.
    """
    if not isinstance(reply, str):
        return None
    best: tuple[int, int, str] | None = None
    for tag in tags:
        m = re.search(f"<{re.escape(tag)}>", reply, re.IGNORECASE | re.ASCII)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), m.end(), tag)
    if best is None:
        return None
    close = re.compile(f"</{re.escape(best[2])}>", re.IGNORECASE | re.ASCII).search(reply, best[1])
    if close is None:
        return None
    return best[2], reply[best[1] : close.start()].strip()


# ---- tools -------------------------------------------------------------------------------------------------------
class ToolError(Exception):
    """A failure the model should read: bad arguments, a refused expression, a failing backend."""


class TransientToolError(ToolError):
    """A failure worth retrying (a timeout, a busy backend). Tools raise it, or list exception types in `retry_on`."""


@dataclass
class Tool:
    """`fn` takes the validated `args_model` instance and returns something printable (str() of it is shown)."""

    name: str
    description: str
    args_model: type[BaseModel]
    fn: Callable[[BaseModel], Any]
    retry_on: tuple[type[BaseException], ...] = (TransientToolError, TimeoutError, ConnectionError)
    cacheable: bool = True  # pure tools only: a cached result is returned without running the tool again

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema (what chat templates with tool support take)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.args_model.model_json_schema()}}

    def signature(self) -> str:
        """One line for a prompt: name, arguments with types, description."""
        props = self.args_model.model_json_schema().get("properties", {})
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        return f"{self.name}({args}): {self.description}"


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None) -> Any:
    """Make a `Tool` from a plain function, usable as ``@tool`` or ``@tool(name=...)``.

    A function whose single parameter is annotated with a pydantic model takes that model; otherwise the argument
    model is built from the function's annotated keyword parameters (defaults kept). The description defaults to the
    first line of the docstring.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        params = list(inspect.signature(f).parameters.values())
        hints = inspect.get_annotations(f, eval_str=True)
        doc = (inspect.getdoc(f) or "").strip().splitlines()
        desc = description or (doc[0] if doc else f.__name__)
        if len(params) == 1 and isinstance(hints.get(params[0].name), type) and \
                issubclass(hints[params[0].name], BaseModel):
            return Tool(name or f.__name__, desc, hints[params[0].name], f)
        fields = {p.name: (hints.get(p.name, Any), ... if p.default is inspect.Parameter.empty else p.default)
                  for p in params}
        model = create_model(f"{f.__name__}_args", __config__=ConfigDict(extra="forbid"), **fields)
        return Tool(name or f.__name__, desc, model, lambda args: f(**args.model_dump()))

    return wrap(fn) if fn is not None else wrap


# ---- calculator: arithmetic on an AST whitelist --------------------------------------------------------------------
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 256
MAX_MAGNITUDE = 10**30  # results and operands beyond this are refused: arithmetic word problems never need them
MAX_EXPONENT = 64


def _check(value: Any) -> Any:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ToolError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError("number too large")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool, str, complex are refused
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            # Guard before computing: 9**9**9 would take minutes and gigabytes.
            if abs(right) > MAX_EXPONENT or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 30):
                raise ToolError("power too large")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except (OverflowError, ZeroDivisionError, TypeError) as err:
            raise ToolError(str(err)) from err
    raise ToolError(f"unsupported syntax: {type(node).__name__} (only numbers, + - * / // % ** and parentheses)")


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely. Accepts ^ for power, x or × for times, ÷ for divide and thousands
    separators ("1,000"); raises ToolError on anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", expression)
    text = text.replace("^", "**").replace("×", "*").replace("÷", "/")
    text = re.sub(r"(?<=[\d)\s])x(?=[\d(\s])", "*", text)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError) as err:
        raise ToolError(f"cannot parse expression: {getattr(err, 'msg', err)}") from err
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return round(value, 10) if isinstance(value, float) else value


class CalculatorArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expression: str = Field(..., max_length=MAX_EXPRESSION_CHARS,
                            description="arithmetic with numbers, + - * / // % ** and parentheses")


CALCULATOR = Tool("calculator", "Evaluate an arithmetic expression and return the number.", CalculatorArgs,
                  lambda args: calculate(args.expression))


class RetrieveArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(..., min_length=1, max_length=512, description="what to search for")
    k: int = Field(3, ge=1, le=10, description="how many passages")


def retrieve_tool(retriever: Any, name: str = "retrieve") -> Tool:
    """A tool that searches `retriever` (see `envs.retrieval.Retriever`) and returns numbered passages."""

    def run(args: RetrieveArgs) -> str:
        hits = retriever.search([args.query], args.k)[0]
        return "\n".join(f"[{i}] {p}" for i, p in enumerate(hits, 1)) or "no results"

    return Tool(name, "Search the document collection and return the most relevant passages.", RetrieveArgs, run)


BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {"calculator": lambda: CALCULATOR}


def load_tool(spec: str | Tool | Callable[..., Any]) -> Tool:
    """A Tool from a built-in name, an import path ``"package.module:attr"`` (a Tool, a function made one with
    `tool`, or a class / factory returning either), or the object itself."""
    if isinstance(spec, Tool):
        return spec
    if isinstance(spec, str):
        if spec in BUILTIN_TOOLS:
            return BUILTIN_TOOLS[spec]()
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ValueError(f"unknown tool {spec!r}; built-in: {sorted(BUILTIN_TOOLS)}, or 'package.module:attr'")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot load tool {spec!r}: {err}") from err
        return load_tool(obj)
    if isinstance(spec, type):  # a class: instantiate with no arguments; the instance must be a Tool or callable
        return load_tool(spec())
    if callable(spec):
        return tool(spec)
    raise ValueError(f"cannot make a tool from {spec!r}")


class ToolCall(NamedTuple):
    name: str
    arguments: dict[str, Any]


class ToolResult(NamedTuple):
    ok: bool
    output: str
    call: ToolCall | None = None  # canonical (validated) call, when the reply held one
    attempts: int = 0
    cached: bool = False


def render_call(call: ToolCall) -> str:
    """The canonical text of a call: one JSON object (name, then arguments) inside <tool_call></tool_call>."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=True)
    return f"<tool_call>{body}</tool_call>"


def parse_call(text: str) -> ToolCall:
    """The JSON inside <tool_call>: {"name": str, "arguments": object}; key case is forgiven. Raises ToolError."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ToolError(f"tool call is not valid JSON: {getattr(err, 'msg', err)}") from err
    if not isinstance(obj, dict):
        raise ToolError('a tool call is a JSON object: {"name": ..., "arguments": {...}}')
    keys = {str(k).lower(): v for k, v in obj.items()}
    name, args = keys.get("name"), keys.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ToolError('a tool call needs "name" (a string)')
    if not isinstance(args, dict):
        raise ToolError('"arguments" must be a JSON object')
    return ToolCall(name, args)


class ToolRegistry:
    """Tools by name, with validation, bounded retries of transient errors and an LRU cache of results."""

    def __init__(self, tools: Iterable[str | Tool | Callable[..., Any]] = (), max_retries: int = 2,
                 cache_size: int = 256, max_output_chars: int = 2000):
        self.tools: dict[str, Tool] = {}
        self.max_retries = max_retries
        self.cache_size = cache_size
        self.max_output_chars = max_output_chars
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        for t in tools:
            self.register(t)

    def register(self, spec: str | Tool | Callable[..., Any]) -> Tool:
        t = load_tool(spec)
        self.tools[t.name.lower()] = t
        return t

    def describe(self) -> str:
        return "\n".join(t.signature() for t in self.tools.values())

    def validate(self, call: ToolCall) -> tuple[Tool, BaseModel]:
        """The tool and its validated arguments; ToolError naming the bad fields otherwise. Tool and argument names
        match case-insensitively (small models capitalise freely)."""
        t = self.tools.get(call.name.lower())
        if t is None:
            raise ToolError(f"unknown tool {call.name!r}; available: {', '.join(self.tools)}")
        fields = {f.lower(): f for f in t.args_model.model_fields}
        args = {fields.get(str(k).lower(), k): v for k, v in call.arguments.items()}
        try:
            return t, t.args_model.model_validate(args)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in err.errors())
            raise ToolError(f"invalid arguments for {t.name}: {problems}") from None

    def run(self, call: ToolCall | str) -> ToolResult:
        """Run a call (or the JSON text of one). Never raises: failures come back as ok=False with the error text."""
        try:
            if isinstance(call, str):
                call = parse_call(call)
            t, args = self.validate(call)
        except ToolError as err:
            return ToolResult(False, f"Error: {err}", call if isinstance(call, ToolCall) else None)
        canonical = ToolCall(t.name, args.model_dump(mode="json"))
        key = (t.name, json.dumps(canonical.arguments, sort_keys=True))
        if t.cacheable and key in self._cache:
            self._cache.move_to_end(key)
            return ToolResult(True, self._cache[key], canonical, 0, cached=True)
        attempts = 0
        while True:
            attempts += 1
            try:
                output = str(t.fn(args))[: self.max_output_chars]
                break
            except t.retry_on as err:
                if attempts > self.max_retries:
                    return ToolResult(False, f"Error: {t.name} failed after {attempts} attempts: {err}", canonical,
                                      attempts)
            except ToolError as err:
                return ToolResult(False, f"Error: {t.name}: {err}", canonical, attempts)
            except Exception as err:  # a bug or refusal inside the tool is the model's observation, not a crash
                return ToolResult(False, f"Error: {t.name} raised {type(err).__name__}: {err}", canonical, attempts)
        if t.cacheable and self.cache_size > 0:
            self._cache[key] = output
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return ToolResult(True, output, canonical, attempts)
