"""verl's multi-turn rollout settings -> tandem's agent loops (``agent.*``, docs/agents.md).

verl runs tool episodes in its agent loops: each row's ``agent_name`` (or
``rollout.agent.default_agent_loop``) picks the loop, ``tool_agent`` generates, runs the tool
calls of a turn and appends their results, and the tools come from a YAML file
(``rollout.multi_turn.tool_config_path``) naming a Python class per tool. tandem has the same
loops (``single_turn``, ``tool_agent``; a row's ``agent_name`` column picks one) and runs its
built-in tools and plain functions, not verl's tool classes: a tool whose class tandem cannot
run is refused, naming the tool. The one verl class with a tandem equivalent is verl's
sandbox-fusion code tool, which becomes tandem's sandboxed ``python`` tool.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from tandem.verl.keys import ROLLOUT

if TYPE_CHECKING:
    from tandem.verl.context import Context

MULTI_TURN = f"{ROLLOUT}.multi_turn"
AGENT = f"{ROLLOUT}.agent"

LOOPS = {"single_turn_agent": "single_turn", "tool_agent": "tool_agent"}  # verl's name -> tandem's
PARSERS = {"hermes": "hermes"}
CODE_TOOLS = ("verl.tools.sandbox_fusion_tools.SandboxFusionTool",)  # verl 0.7's code interpreter


def agent_loops(ctx: Context) -> None:
    """The agent loop, its tools and its turn limit; nothing when the command uses neither tools
    nor a multi-turn loop (verl's default: one turn per prompt)."""
    loop = ctx.get(f"{AGENT}.default_agent_loop")
    if loop not in LOOPS:
        raise ValueError(
            f"{AGENT}.default_agent_loop={loop}: tandem's loops are {sorted(LOOPS)} (as verl names them); "
            "a loop of your own registers with tandem.agents.loops.AGENT_LOOPS"
        )
    parser = ctx.get(f"{MULTI_TURN}.format")
    if parser not in PARSERS:
        raise ValueError(f"{MULTI_TURN}.format={parser}: tandem reads tool calls as {sorted(PARSERS)}")
    tools_file = ctx.get(f"{MULTI_TURN}.tool_config_path")
    if tools_file is None and loop == "single_turn_agent":
        given = sorted(
            key for key in ctx.given if key.startswith(f"{MULTI_TURN}.") or key.startswith(f"{AGENT}.")
        )
        if given:
            ctx.notes.append(
                f"{', '.join(given)}: no tools and no multi-turn loop, so episodes are single-turn"
            )
        return
    ctx.out["agent.name"] = LOOPS[loop]
    ctx.out["agent.max_turns"] = _model_turns(ctx)
    ctx.out["agent.tool_parser"] = PARSERS[parser]
    if tools_file is not None:
        _tools(ctx, str(tools_file))
    _differences(ctx)


def _model_turns(ctx: Context) -> int:
    """tandem's ``agent.max_turns``. verl ends an episode after an assistant turn once it has made
    ``max_assistant_turns`` of them, or once ``max_user_turns`` tool or user turns came before it:
    ``min(max_assistant_turns, max_user_turns + 1)`` model turns. Without limits the response
    budget ends the episode; each model turn takes a token at least, so the budget is the bound."""
    limits = [int(ctx.get("data.max_response_length"))]
    assistant, user = ctx.get(f"{MULTI_TURN}.max_assistant_turns"), ctx.get(f"{MULTI_TURN}.max_user_turns")
    if assistant:
        limits.append(int(assistant))
    if user:
        limits.append(int(user) + 1)
    return min(limits)


def _tools(ctx: Context, path: str) -> None:
    """The tools of verl's tool config file: each must be one tandem can run."""
    key = f"{MULTI_TURN}.tool_config_path"
    entries = _read_tool_config(key, path)
    for index, entry in enumerate(entries):
        class_name = str(entry.get("class_name"))
        name = str(((entry.get("tool_schema") or {}).get("function") or {}).get("name"))
        if class_name not in CODE_TOOLS:
            raise ValueError(
                f"{key}={path}: tool {name!r} ({class_name}) cannot run in tandem, which does not load "
                "verl's tool classes; tandem runs its calculator and sandboxed python tools and plain "
                "functions from a file (--set agent.tools_path=FILE, docs/agents.md)"
            )
        _code_tool(ctx, f"{key}={path}: tool {index} ({name!r})", entry.get("config") or {})
        ctx.notes.append(
            f"{key}: verl's sandbox-fusion tool {name!r} becomes tandem's sandboxed python tool, which "
            "the model sees as 'python' with the same 'code' argument; it runs locally (no sandbox server)"
        )
    ctx.out["agent.tools"] = ["python"]


def _read_tool_config(key: str, path: str) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{key}={path}: no such file (verl's tool config, a YAML file with a 'tools' list)")
    try:
        loaded = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"{key}={path}: not valid YAML ({error})") from None
    entries = loaded.get("tools") if isinstance(loaded, dict) else None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries) or not entries:
        raise ValueError(
            f"{key}={path}: expected a 'tools' list of {{class_name, config, tool_schema}} entries"
        )
    return entries


def _code_tool(ctx: Context, where: str, config: dict) -> None:
    """The sandbox limits of verl's code tool: its timeout and memory limit."""
    language = config.get("default_language", "python")
    if language != "python":
        raise ValueError(f"{where}: default_language={language!r}; tandem's sandbox runs python only")
    if config.get("default_timeout") is not None:
        seconds = float(config["default_timeout"])
        ctx.out["agent.python.wall_seconds"] = seconds
        ctx.out["agent.python.cpu_seconds"] = math.ceil(seconds)
    if config.get("memory_limit_mb") is not None:
        ctx.out["agent.python.memory_mb"] = int(config["memory_limit_mb"])


def _differences(ctx: Context) -> None:
    """Notes for verl settings whose behaviour tandem does not copy."""
    calls = ctx.get(f"{MULTI_TURN}.max_parallel_calls")
    ctx.notes.append(
        f"{MULTI_TURN}.max_parallel_calls={calls}: verl runs the first {calls} tool call(s) of a turn and "
        "drops the rest; tandem runs every call of a turn (agent.tool_concurrency at once)"
    )
    # verl cuts a tool response to max_tool_response_length characters, keeping its middle side's ends
    ctx.out["agent.max_message_chars"] = int(ctx.get(f"{MULTI_TURN}.max_tool_response_length"))
    side = ctx.get(f"{MULTI_TURN}.tool_response_truncate_side")
    if side != "middle":
        ctx.notes.append(
            f"{MULTI_TURN}.tool_response_truncate_side={side}: tandem keeps the first and last halves of "
            "a long tool response (verl's 'middle'); agent.max_message_chars also caps interaction replies"
        )
