"""Tool calling for text agents: tools declared with pydantic schemas, a registry, and a safe executor.

A tool is a name, a description and a pydantic model of its arguments (its JSON schema is what the model is shown).
The model calls one inside its reply as JSON::

    <tool_call>{"name": "calculator", "arguments": {"expression": "(12 + 3) * 4"}}</tool_call>

`ToolRegistry.run` validates the arguments against the schema before anything runs, retries transient failures a
bounded number of times, caches results (LRU), and turns every failure (bad JSON, unknown tool, schema error, an
exception inside the tool) into an error text for the next observation: a tool never crashes the episode.

Built-in tools: `calculator` (safe arithmetic on an `ast` whitelist, no `eval`) and `retrieve` (wraps a
`envs.retrieval.Retriever`). Others load by name or import path ``"package.module:function_or_class"``.

Tools written for verl load too (`load_tools_config`: verl's tool YAML, ``tools: [{class_name, config,
tool_schema}]``). Such a tool is a class with verl's async interface, ``create(instance_id, **create_kwargs)``,
``execute(instance_id, parameters, **execute_kwargs)`` and ``release(instance_id)``: one instance per trajectory,
created at its first call with that trajectory's `tools_kwargs` (a task row's per-sample arguments, e.g. the
ground truth a reward tool checks), released when the episode ends (`ToolSession`). Its arguments are validated
against the YAML's JSON schema. verl's own built-in class names map to raygent's equivalents (`VERL_EQUIVALENTS`),
so verl's example YAMLs load without verl installed. Calls in one reply run concurrently (`ToolRegistry.arun_many`).
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import importlib
import inspect
import json
import logging
import math
import operator
import re
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

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


def find_all_tagged(reply: str, tag: str) -> list[str]:
    """The stripped inner texts of every closed ``<tag>...</tag>`` in `reply`, in order (case-insensitive)."""
    if not isinstance(reply, str):
        return []
    name = re.escape(tag)
    return [m.group(1).strip() for m in re.finditer(f"<{name}>(.*?)</{name}>", reply, re.IGNORECASE | re.ASCII |
                                                     re.DOTALL)]


# ---- tools -------------------------------------------------------------------------------------------------------
class ToolError(Exception):
    """A failure the model should read: bad arguments, a refused expression, a failing backend."""


class TransientToolError(ToolError):
    """A failure worth retrying (a timeout, a busy backend). Tools raise it, or list exception types in `retry_on`."""


@dataclass
class Tool:
    """`fn` takes the validated `args_model` instance and returns something printable (str() of it is shown), or an
    awaitable of it (an async tool: calls of one reply then run concurrently)."""

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
    reward: float = 0.0  # a session tool's step reward (verl's execute returns one); 0 for plain tools


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


# ---- tools with verl's interface: one instance per trajectory -------------------------------------------------------
log = logging.getLogger(__name__)
T = TypeVar("T")


class FunctionSpec(BaseModel):
    """An OpenAI function declaration (what a chat template's `tools=` takes)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class FunctionToolSchema(BaseModel):
    """A tool's schema as verl's YAML writes it (`tool_schema`): attribute access as verl's tool classes use it
    (`self.tool_schema.function.name`), `model_dump()` for the template."""

    model_config = ConfigDict(extra="allow")
    type: str = "function"
    function: FunctionSpec


class SessionTool:
    """A tool object with verl's interface (`impl`: async `create`, `execute`, optional `release`), its schema, and
    its arguments' JSON-schema validator. Stateful per trajectory, so never cached."""

    cacheable = False
    retry_on: tuple[type[BaseException], ...] = (TransientToolError, TimeoutError, ConnectionError)

    def __init__(self, impl: Any, schema: FunctionToolSchema):
        import jsonschema

        for method in ("create", "execute"):
            if not inspect.iscoroutinefunction(getattr(impl, method, None)):
                raise ValueError(f"{type(impl).__name__} has no async {method}(): a tool class needs verl's async "
                                 "create / execute / release interface")
        try:
            jsonschema.validators.validator_for(schema.function.parameters).check_schema(schema.function.parameters)
        except jsonschema.SchemaError as err:
            raise ValueError(f"tool {schema.function.name!r}: its parameters are not a JSON schema: {err.message}") \
                from None
        self.impl, self.spec = impl, schema
        self.name, self.description = schema.function.name, schema.function.description
        self._validator = jsonschema.validators.validator_for(schema.function.parameters)(schema.function.parameters)
        self._create_takes = inspect.signature(impl.create).parameters

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.spec.function.parameters}}

    def signature(self) -> str:
        props = self.spec.function.parameters.get("properties", {})
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        return f"{self.name}({args}): {self.description}"

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        if errors:
            problems = "; ".join(f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
                                 for e in errors)
            raise ToolError(f"invalid arguments for {self.name}: {problems}")
        return arguments

    def takes(self, name: str) -> bool:
        """Whether `create` names the keyword `name` (raygent passes an env's ground truth only to those)."""
        return name in self._create_takes


def _response_text(response: Any) -> str:
    """verl tools answer with a str, a dict with "text", or an object with `.text` (its ToolResponse)."""
    if isinstance(response, dict):
        return str(response.get("text") or "")
    return str(getattr(response, "text", response) or "")


class ToolSession:
    """One trajectory's tool state: its per-sample `tools_kwargs` (verl's layout, ``{tool name: {"create_kwargs":
    {...}, "execute_kwargs": {...}}}``) and the session tools' instances, created at their first call and released
    by `close` (the env closes it when the episode ends or a new one starts)."""

    def __init__(self, tools_kwargs: dict[str, Any] | None = None):
        self.tools_kwargs: dict[str, Any] = dict(tools_kwargs or {})
        self.instances: dict[str, tuple[SessionTool, str]] = {}
        self._creating: dict[str, asyncio.Future] = {}

    def kwargs(self, tool_name: str, kind: str) -> dict[str, Any]:
        entry = self.tools_kwargs.get(tool_name) or {}
        return dict(entry.get(kind) or {}) if isinstance(entry, dict) else {}

    def cache_key(self, tool_name: str) -> str:
        """What a cached result of `tool_name` depends on besides its arguments: this trajectory's kwargs for it."""
        return json.dumps(self.tools_kwargs.get(tool_name) or {}, sort_keys=True, default=str)

    async def instance(self, tool: SessionTool) -> str:
        if tool.name in self.instances:
            return self.instances[tool.name][1]
        if tool.name not in self._creating:  # concurrent first calls of one tool share one create
            self._creating[tool.name] = asyncio.ensure_future(self._create(tool))
        return await asyncio.shield(self._creating[tool.name])

    async def _create(self, tool: SessionTool) -> str:
        try:
            created = await tool.impl.create(str(uuid.uuid4()), **self.kwargs(tool.name, "create_kwargs"))
        finally:
            self._creating.pop(tool.name, None)
        instance_id = str(created[0] if isinstance(created, tuple) else created)  # newer verl returns (id, response)
        self.instances[tool.name] = (tool, instance_id)
        return instance_id

    async def close(self) -> None:
        """Release every instance (a release that fails is logged: the episode's result stands)."""
        instances, self.instances = self.instances, {}
        for tool, instance_id in instances.values():
            release = getattr(tool.impl, "release", None)
            if release is None:
                continue
            try:
                await release(instance_id)
            except Exception:  # noqa: BLE001  a user tool's cleanup must not fail the episode
                log.exception("releasing %s instance %s failed", tool.name, instance_id)

    def close_now(self) -> None:
        if self.instances:
            run_sync(self.close())


def run_sync(coroutine: Awaitable[T]) -> T:
    """Run a coroutine to its end from synchronous code: on this thread, or, where this thread already runs an event
    loop (asyncio.run refuses there: `env.step` inside an async actor, a Serve replica's constructor building the
    default model), on its own loop in a helper thread, waiting for it. The one such helper: the episode runner's
    synchronous callers use it too (`actors.episodes`)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)  # type: ignore[arg-type]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()  # type: ignore[arg-type]


class AnswerCheck:
    """raygent's equivalent of verl's GSM8K reward tool (``verl.tools.gsm8k_tool.Gsm8kTool``): the agent submits an
    answer, the tool says whether it equals the trajectory's ground truth (``create_kwargs: {ground_truth}``).
    Its step reward is 0; `calc_reward` gives the last answer's score (1 or 0)."""

    default_schema = {"type": "function", "function": {
        "name": "calc_gsm8k_reward", "description": "Check an answer to the question (returns whether it is right)",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string",
                                                                   "description": "the final number"}},
                       "required": ["answer"]}}}

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: FunctionToolSchema | None = None):
        self.config = config or {}
        self.tool_schema = tool_schema or FunctionToolSchema.model_validate(self.default_schema)
        self._truth: dict[str, str | None] = {}
        self._score: dict[str, float] = {}

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **_: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._truth[instance_id] = None if ground_truth is None else str(ground_truth)
        self._score[instance_id] = 0.0
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **_: Any) -> tuple[str, float, dict]:
        from envs.data.arithmetic import parse_number

        truth = self._truth[instance_id]
        if truth is None:
            raise ToolError("this task has no ground truth to check against (tools_kwargs: create_kwargs)")
        answer = str(parameters.get("answer", "")).removeprefix("####").strip()
        value, expected = parse_number(answer), parse_number(truth)
        self._score[instance_id] = float(value is not None and value == expected)
        verdict = "correct" if self._score[instance_id] else "not correct"
        return f"answer {answer or '(empty)'} is {verdict}", 0.0, {}

    async def calc_reward(self, instance_id: str, **_: Any) -> float:
        return self._score[instance_id]

    async def release(self, instance_id: str, **_: Any) -> None:
        self._truth.pop(instance_id, None)
        self._score.pop(instance_id, None)


class Search:
    """raygent's equivalent of verl's search tool (``verl.tools.search_tool.SearchTool``): top-k passages for each
    query of ``query_list``. `config`: ``retrieval_service_url`` (raygent's retrieval server, `app/retriever.py`:
    ``POST {queries, k}``) or, without it, BM25 over the built-in encyclopedia (`corpus_seed`); ``topk``."""

    default_schema = {"type": "function", "function": {
        "name": "search", "description": "Search the document collection; returns the most relevant passages",
        "parameters": {"type": "object", "properties": {"query_list": {
            "type": "array", "items": {"type": "string"}, "minItems": 1,
            "description": "one or more queries"}}, "required": ["query_list"]}}}

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: FunctionToolSchema | None = None):
        self.config = config or {}
        self.tool_schema = tool_schema or FunctionToolSchema.model_validate(self.default_schema)
        self.topk = int(self.config.get("topk", 3))
        self.url = self.config.get("retrieval_service_url")
        self._local: Any = None

    def _search(self, queries: list[str]) -> list[list[str]]:
        if self.url:
            import urllib.request

            body = json.dumps({"queries": queries, "k": self.topk}).encode()
            request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=float(self.config.get("timeout", 30))) as reply:
                return json.loads(reply.read())["results"]
        if self._local is None:
            from envs.data.encyclopedia import build_encyclopedia
            from envs.retrieval import BM25Retriever

            self._local = BM25Retriever(build_encyclopedia(int(self.config.get("corpus_seed", 0))).passages)
        return self._local.search(queries, self.topk)

    async def create(self, instance_id: str | None = None, **_: Any) -> str:
        return instance_id or str(uuid.uuid4())

    async def execute(self, instance_id: str, parameters: dict[str, Any], **_: Any) -> tuple[str, float, dict]:
        queries = [str(q) for q in parameters["query_list"]]
        results = await asyncio.to_thread(self._search, queries)
        text = "\n".join(f"Query {q!r}:\n" + "\n".join(f"[{i}] {p}" for i, p in enumerate(hits, 1))
                         for q, hits in zip(queries, results, strict=True))
        return text or "no results", 0.0, {}

    async def release(self, instance_id: str, **_: Any) -> None:
        pass


# verl's class names for its built-in tools -> raygent's equivalents (verl need not be installed)
VERL_EQUIVALENTS = {"verl.tools.gsm8k_tool.Gsm8kTool": "envs.tools:AnswerCheck",
                    "verl.tools.search_tool.SearchTool": "envs.tools:Search"}


def _import(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep:  # verl writes "package.module.Class"
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not 'package.module:Class' or 'package.module.Class'")
    return getattr(importlib.import_module(module_name), attr)


def load_tools_config(path: str | Path) -> list[SessionTool]:
    """The tools of a verl tool YAML: ``tools: [{class_name, config: {type: native, ...}, tool_schema}]``. Each class
    is built as verl builds it, ``cls(config=..., tool_schema=...)``; without a `tool_schema` the class's
    `get_openai_tool_schema()` (or `tool_schema` attribute) gives it. ValueError names the entry and field."""
    import yaml

    where = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"tools_config {where}: cannot read it: {err}") from None
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"tools_config {where}: needs 'tools', a list of {{class_name, config, tool_schema}}")
    out = []
    for i, entry in enumerate(entries):
        at = f"tools_config {where}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{at}.class_name: required (a class by import path, or one of {sorted(VERL_EQUIVALENTS)})")
        config = dict(entry.get("config") or {})
        kind = config.get("type", "native")
        if kind != "native":
            raise ValueError(f"{at}.config.type: {kind!r} is not supported; allowed: 'native' (MCP and other "
                             "remote tool types are not loaded by raygent)")
        try:
            cls = _import(VERL_EQUIVALENTS.get(entry["class_name"], entry["class_name"]))
        except (ImportError, AttributeError) as err:
            raise ValueError(f"{at}.class_name: cannot load {entry['class_name']!r}: {err}") from None
        try:
            schema = (FunctionToolSchema.model_validate(entry["tool_schema"]) if entry.get("tool_schema")
                      else None)
        except ValidationError as err:
            raise ValueError(f"{at}.tool_schema: {err.errors()[0]['loc']}: {err.errors()[0]['msg']}") from None
        try:
            impl = cls(config=config, tool_schema=schema)
            if schema is None:
                own = getattr(impl, "get_openai_tool_schema", None)
                own = own() if callable(own) else getattr(impl, "tool_schema", None)
                if own is None:
                    raise ValueError(f"{at}.tool_schema: required ({entry['class_name']} has none of its own)")
                schema = FunctionToolSchema.model_validate(own if isinstance(own, dict) else own.model_dump())
            out.append(SessionTool(impl, schema))
        except Exception as err:  # noqa: BLE001  the user's class: say which entry failed, and how
            raise ValueError(f"{at}: {entry['class_name']}(config, tool_schema): {type(err).__name__}: {err}") \
                from None
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"tools_config {where}: tool names repeat: {names}")
    return out


class ToolRegistry:
    """Tools by name, with validation, bounded retries of transient errors, an LRU cache of pure tools' results
    (keyed by the trajectory's kwargs for the tool as well, so per-sample kwargs never leak across episodes), and
    concurrent calls (`arun_many`)."""

    def __init__(self, tools: Iterable[str | Tool | SessionTool | Callable[..., Any]] = (), max_retries: int = 2,
                 cache_size: int = 256, max_output_chars: int = 2000, call_timeout_s: float = 60.0):
        self.tools: dict[str, Tool | SessionTool] = {}
        self.max_retries = max_retries
        self.cache_size = cache_size
        self.max_output_chars = max_output_chars
        self.call_timeout_s = call_timeout_s
        self._cache: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        for t in tools:
            self.register(t)

    def register(self, spec: str | Tool | SessionTool | Callable[..., Any]) -> Tool | SessionTool:
        t = spec if isinstance(spec, SessionTool) else load_tool(spec)
        self.tools[t.name.lower()] = t
        return t

    def describe(self) -> str:
        return "\n".join(t.signature() for t in self.tools.values())

    def validate(self, call: ToolCall) -> tuple[Tool | SessionTool, Any]:
        """The tool and its validated arguments (a pydantic model for a `Tool`, the checked dict for a
        `SessionTool`); ToolError naming the bad fields otherwise. Tool and argument names match
        case-insensitively for `Tool`s (small models capitalise freely)."""
        t = self.tools.get(call.name.lower())
        if t is None:
            raise ToolError(f"unknown tool {call.name!r}; available: {', '.join(self.tools)}")
        if isinstance(t, SessionTool):
            return t, t.validate(call.arguments)
        fields = {f.lower(): f for f in t.args_model.model_fields}
        args = {fields.get(str(k).lower(), k): v for k, v in call.arguments.items()}
        try:
            return t, t.args_model.model_validate(args)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in err.errors())
            raise ToolError(f"invalid arguments for {t.name}: {problems}") from None

    def run(self, call: ToolCall | str, session: ToolSession | None = None) -> ToolResult:
        """`arun` from synchronous code."""
        return run_sync(self.arun(call, session))

    async def arun_many(self, calls: list[ToolCall | str], session: ToolSession | None = None) -> list[ToolResult]:
        """The calls of one reply, run concurrently; results in call order."""
        return list(await asyncio.gather(*(self.arun(c, session) for c in calls)))

    async def arun(self, call: ToolCall | str, session: ToolSession | None = None) -> ToolResult:
        """Run a call (or the JSON text of one) in trajectory `session`. Never raises: failures come back as
        ok=False with the error text."""
        try:
            if isinstance(call, str):
                call = parse_call(call)
            t, args = self.validate(call)
        except ToolError as err:
            return ToolResult(False, f"Error: {err}", call if isinstance(call, ToolCall) else None)
        session = session or ToolSession()
        canonical = ToolCall(t.name, args if isinstance(t, SessionTool) else args.model_dump(mode="json"))
        key = (t.name, json.dumps(canonical.arguments, sort_keys=True), session.cache_key(t.name))
        if t.cacheable and key in self._cache:
            self._cache.move_to_end(key)
            return ToolResult(True, self._cache[key], canonical, 0, cached=True)
        attempts, reward = 0, 0.0
        while True:
            attempts += 1
            try:
                if isinstance(t, SessionTool):
                    instance_id = await asyncio.wait_for(session.instance(t), self.call_timeout_s)
                    answer = await asyncio.wait_for(
                        t.impl.execute(instance_id, args, **session.kwargs(t.name, "execute_kwargs")),
                        self.call_timeout_s)
                    response, reward = (answer[0], float(answer[1] or 0.0)) if isinstance(answer, tuple) else (
                        answer, 0.0)
                    output = _response_text(response)[: self.max_output_chars]
                else:
                    value = t.fn(args)
                    if inspect.isawaitable(value):
                        value = await asyncio.wait_for(value, self.call_timeout_s)
                    output = str(value)[: self.max_output_chars]
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
        return ToolResult(True, output, canonical, attempts, reward=reward)
