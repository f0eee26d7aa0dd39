"""Tools an agent can call: declared with OpenAI function schemas, run concurrently, never fatal.

A :class:`Tool` is a name, a description, a JSON schema of its arguments and a function that
returns text. Built in: ``calculator`` (arithmetic on numbers, evaluated from the syntax tree,
no names or calls) and ``python`` (code run in the sandbox, :mod:`tandem.agents.sandbox`). User
tools come from a Python file (``agent.tools_path``): every function listed in its ``TOOLS``
becomes a tool, its schema built from the signature (``str``, ``int``, ``float``, ``bool``
parameters) and its docstring. A broken file (a failing import, a parameter without a type,
an entry that is not a function, a name given twice) is a ``ValueError`` naming
``agent.tools_path`` and the entry, raised when the config is built.

:class:`ToolRunner` runs one turn's calls (in parallel, at most ``concurrency`` across all
samples at once): an unknown tool, arguments that do not fit the schema, a tool that raises
(``SystemExit`` included), returns something other than text, or runs past ``timeout_s`` each
come back as the tool message's text (``error: ...``) and are counted; per-tool calls, errors
and seconds feed the ``agent/*`` metrics. Each call runs on a thread of its own, so a call that
never returns costs its thread, never a worker of the pool or the step: Python cannot stop a
thread, so it is left to end by itself (a daemon, it does not keep the process alive;
:mod:`tandem.user_calls`).
"""

from __future__ import annotations

import ast
import inspect
import operator
import re
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tandem.agents.sandbox import SandboxLimits, run_python
from tandem.agents.tool_calls import ToolCall
from tandem.config.user_code import load_user_module
from tandem.user_calls import UserCodeError, start_user_call, wait_user_call

UNKNOWN_TOOL = "unknown_tool"
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what OpenAI's function schema allows


@dataclass(frozen=True)
class Tool:
    """A callable tool: ``function(**arguments) -> str``; checked when built, so a malformed one
    fails where it is declared rather than at its first call."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    function: Callable[..., str]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TOOL_NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        if not isinstance(self.description, str):
            raise ValueError(
                f"tool {self.name!r}: description must be text, got {type(self.description).__name__}"
            )
        problem = _schema_problem(self.parameters)
        if problem:
            raise ValueError(f"tool {self.name!r}: {problem}")
        if not callable(self.function):
            raise ValueError(
                f"tool {self.name!r}: function must be callable, got {type(self.function).__name__}"
            )

    def schema(self) -> dict:
        """The OpenAI function schema (what chat templates render in the system prompt)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def tool_from_function(function: Callable[..., object]) -> Tool:
    """A tool from a plain function: name, first docstring paragraph, and a schema of its
    annotated parameters (those without a default are required)."""
    properties, required = {}, []
    for name, parameter in inspect.signature(function).parameters.items():
        kind = JSON_TYPES.get(parameter.annotation)
        if kind is None:
            raise ValueError(
                f"tool {function.__name__!r}: parameter {name!r} needs a str, int, float or bool annotation"
            )
        properties[name] = {"type": kind}
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    description = (inspect.getdoc(function) or function.__name__).split("\n\n")[0].replace("\n", " ")
    schema = {"type": "object", "properties": properties, "required": required}
    return Tool(function.__name__, description, schema, lambda **kwargs: _as_text(function(**kwargs)))


def _as_text(result: object) -> object:
    """A plain function's result as text (numbers welcome); ``None`` is kept, for the runner to
    report: it is what a function that forgot its ``return`` gives."""
    return result if result is None else str(result)


def _schema_problem(schema: object) -> str:
    """Why ``schema`` is not a JSON schema of an arguments object that :class:`ToolRunner` can
    check calls against (empty when it is)."""
    if not isinstance(schema, dict):
        return f"parameters must be a JSON schema object (a dict), got {type(schema).__name__}"
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
        return "parameters['properties'] must map each argument name to a schema (a dict)"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        return "parameters['required'] must be a list of argument names"
    return ""


# ---------------------------------------------------------------------------- calculator
OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100
MAX_DIGITS = 4000


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."""

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            result = OPERATORS[type(node.op)](left, right)
            if isinstance(result, int) and result.bit_length() > MAX_DIGITS * 3.33:
                raise ValueError(f"a result with more than {MAX_DIGITS} digits")
            return result
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic on numbers")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an expression: {error.msg}") from None
    result = value(tree.body)
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


CALCULATOR = Tool(
    "calculator",
    "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses) and return the result.",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    calculate,
)


# ---------------------------------------------------------------------------- python
def python_tool(limits: SandboxLimits | None = None) -> Tool:
    """``python``: run a program in a fresh sandbox and return what it printed (stdout, then
    stderr, truncated) and how it ended."""
    limits = limits or SandboxLimits()

    def run(code: str) -> str:
        result = run_python(code, limits)
        parts = [result.stdout.rstrip()]
        if result.stderr.strip():
            parts.append(f"stderr:\n{result.stderr.rstrip()}")
        if result.dropped_bytes:
            parts.append(f"[{result.dropped_bytes} bytes of output cut]")
        if result.describe():
            parts.append(f"[{result.describe()}]")
        return "\n".join(part for part in parts if part)

    return Tool(
        "python",
        "Run a Python program in a sandbox (no network, no files outside its directory) and return "
        "what it prints.",
        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        run,
    )


# ---------------------------------------------------------------------------- user tools
def load_user_tools(path: str) -> list[Tool]:
    """The tools of the file at ``path``: its ``TOOLS`` list of functions (or :class:`Tool`).

    Raises ``ValueError`` naming ``agent.tools_path`` and the entry for a file that fails to
    import, an entry that is not a function or a :class:`Tool`, or a function whose parameters
    lack a ``str``/``int``/``float``/``bool`` annotation."""
    where = f"agent.tools_path={path!r}"
    listed = getattr(load_user_module(path, "agent.tools_path"), "TOOLS", None)
    if not isinstance(listed, (list, tuple)) or not listed:
        raise ValueError(f"{where}: define TOOLS = [function, ...] in the file")
    tools = []
    for index, item in enumerate(listed):
        if isinstance(item, Tool):
            tools.append(item)
        elif callable(item):
            try:
                tools.append(tool_from_function(item))
            except (ValueError, TypeError) as error:  # no signature, a parameter without a type
                raise ValueError(f"{where}: TOOLS[{index}]: {error}") from None
        else:
            raise ValueError(
                f"{where}: TOOLS[{index}] is {type(item).__name__} {item!r:.40}, not a function or a Tool"
            )
    return tools


def duplicate_names(names: Sequence[str]) -> list[str]:
    """The tool names given more than once (a call could not say which tool it means)."""
    return sorted(name for name, count in Counter(names).items() if count > 1)


# ---------------------------------------------------------------------------- running calls
@dataclass
class ToolStats:
    """Calls, errors and seconds per tool, accumulated over a batch of episodes."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, name: str, seconds: float, failed: bool) -> None:
        with self.lock:
            self.calls[name] += 1
            self.errors[name] += int(failed)
            self.seconds[name] += seconds

    def totals(self) -> dict[str, tuple[int, int, float]]:
        """``{tool: (calls, errors, seconds)}``: plain numbers, to add up over workers."""
        return {name: (calls, self.errors[name], self.seconds[name]) for name, calls in self.calls.items()}

    def metrics(self) -> dict[str, float]:
        """``agent/tool/errors`` and per tool ``agent/tool/<name>/{calls,errors,latency_s}``."""
        return tool_metrics([self.totals()])


def tool_metrics(totals: list[dict[str, tuple[int, int, float]]]) -> dict[str, float]:
    """``agent/tool/errors`` and per tool ``agent/tool/<name>/{calls,errors,latency_s}`` of
    :meth:`ToolStats.totals` from one or several workers."""
    merged: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for worker in totals:
        for name, counts in worker.items():
            merged[name] = [a + b for a, b in zip(merged[name], counts, strict=True)]
    metrics = {"agent/tool/errors": float(sum(errors for _, errors, _ in merged.values()))}
    for name, (calls, errors, seconds) in merged.items():
        metrics[f"agent/tool/{name}/calls"] = float(calls)
        metrics[f"agent/tool/{name}/errors"] = float(errors)
        metrics[f"agent/tool/{name}/latency_s"] = seconds / max(calls, 1)
    return metrics


class ToolRunner:
    """Runs tool calls against ``tools`` with at most ``concurrency`` in flight, each for at most
    ``timeout_s`` seconds (see the module docstring); returns one result text per call, in order."""

    def __init__(self, tools: list[Tool], concurrency: int = 8, timeout_s: float = 60.0) -> None:
        duplicates = duplicate_names([tool.name for tool in tools])
        if duplicates:
            raise ValueError(f"tools {duplicates} are declared twice")
        self.tools = {tool.name: tool for tool in tools}
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="tandem-tool")
        self.stats = ToolStats()

    def schemas(self) -> list[dict]:
        return [tool.schema() for tool in self.tools.values()]

    def run(self, calls: list[ToolCall]) -> list[str]:
        """The result (or ``error: ...``) of each call, run in parallel."""
        return list(self.pool.map(self._run_one, calls))

    def _run_one(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:  # counted under one name: a model may invent any number of them
            self.stats.record(UNKNOWN_TOOL, 0.0, failed=True)
            return f"error: unknown tool {call.name!r}; the tools are {sorted(self.tools)}"
        problem = _argument_problem(call.arguments, tool.parameters)
        if problem:
            self.stats.record(call.name, 0.0, failed=True)
            return f"error: {problem}"
        started = time.perf_counter()
        try:  # a tool's failure goes back to the model
            text = wait_user_call(
                start_user_call(tool.function, **call.arguments), self.timeout_s, f"tool {call.name!r}"
            )
            if not isinstance(text, str):
                raise UserCodeError(f"tool {call.name!r} returned {type(text).__name__}, not text")
            failed = False
        except UserCodeError as error:
            text, failed = f"error: {error}", True
        self.stats.record(call.name, time.perf_counter() - started, failed)
        return text

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _argument_problem(arguments: dict, schema: dict) -> str:
    """Why ``arguments`` do not fit the schema's properties (missing, unknown, wrong type)."""
    properties = schema.get("properties", {})
    missing = [name for name in schema.get("required", []) if name not in arguments]
    if missing:
        return f"missing argument(s) {missing}"
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        return f"unknown argument(s) {unknown}; expected {sorted(properties)}"
    checks = {"string": str, "integer": int, "number": (int, float), "boolean": bool}
    for name, value in arguments.items():
        kind = properties[name].get("type")
        expected = checks.get(kind)
        if expected is not None and (
            not isinstance(value, expected) or (kind != "boolean" and isinstance(value, bool))
        ):
            return f"argument {name!r} must be a {kind}, got {type(value).__name__}"
    return ""
