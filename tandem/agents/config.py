"""``AgentConfig``: the agent loop, its tools and its limits (``agent.*``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tandem.agents.loops import AGENT_LOOPS, load_interaction
from tandem.agents.program.config import ProgramLimits, check_command, load_program
from tandem.agents.sandbox import SandboxLimits, sandbox_available
from tandem.agents.tool_calls import TOOL_CALL_PARSERS
from tandem.agents.tools import duplicate_names, load_user_tools
from tandem.config.paths import INPUT_PATH, path_field
from tandem.config.validation import check_positive

BUILTIN_TOOLS = ("calculator", "python")


@dataclass(frozen=True)
class AgentConfig:
    """How episodes run (``agent.*``).

    Attributes:
        name: the loop for samples without an ``agent_name`` column: ``single_turn`` (one
            response), ``tool_agent`` (generate, run the tool calls, append the results, until
            an answer without calls, ``max_turns`` or the response budget) or ``interaction``
            (a user function replies after each turn and may end the episode with a reward) or
            ``program`` (the user's agent program, ``agent.program``, runs the episode).
        tools: built-in tools to offer (``calculator``, ``python``).
        tools_path: a Python file whose ``TOOLS`` list adds user tools (loaded when the config is
            built: a broken file is a one-line error before any model loads).
        tool_parser: how tool calls are read from the model's text (``hermes``:
            ``<tool_call>{json}</tool_call>``).
        max_turns: model turns per episode at most.
        tool_concurrency: tool calls running at once, across every episode.
        interaction_path / interaction_name: the file and function of the ``interaction`` loop:
            ``fn(messages, extra_info) -> {"content": str | None, "done": bool, "reward": float | None}``
            (loaded when the config is built, like ``tools_path``).
        tool_timeout_s: seconds one tool call may take; a later one becomes an error the model
            receives (the call's thread is left to finish by itself).
        interaction_timeout_s: seconds one call of the interaction function may take; a later one
            ends the episode with ``interaction_error`` and reward 0.
        max_message_chars: characters kept of each tool result or user reply before it is
            tokenised (the first and last halves, with a note of how many were cut between).
        python: the sandbox limits of the ``python`` tool.
        program: the ``program`` loop's agent: ``file.py`` or ``file.py:function`` (default
            ``run``), ``async def run(client, row) -> float | {"reward": float, "metrics": {...}}``
            called with an ``openai.AsyncOpenAI`` client of the run's endpoint (docs/agents.md;
            loaded when the config is built).
        program_command: the ``program`` loop's agent as a command line instead: its arguments
            as a list (``[python, agent.py]``), run without a shell as one subprocess per episode
            with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (the episode's key) in its environment
            and the row as JSON on stdin; its last line of stdout is its result (a number, or
            ``{"reward": ..., "metrics": {...}}``). A list, not a string, so it is never mistaken
            for ``agent.program``'s file path nor re-split. Exclusive with ``agent.program``.
        program_timeout_s: seconds one episode's program may run; a later one is cancelled (a
            command's whole process group killed) and the episode scores 0 (``program_error``).
        program_max_requests: chat requests one episode may make; one more is refused (400).
        program_max_tokens: tokens the model may sample in one episode, over all its requests;
            past them a request is refused (400).
        program_output_bytes: bytes of stdout and of stderr (each) a command may write; they are
            kept on the row (``agent_program_log``); one byte more kills it (``program_error``).
            A function program's prints are kept up to the same cap (the rest counted, no fault).
        program_sandbox: run ``agent.program_command`` in the OS sandbox (the ``python`` tool's,
            under ``agent.python``'s memory, file-size and process limits), its network limited
            to its endpoint (docs/agents.md).
        program_sandbox_mounts: more host files or directories a sandboxed command sees, read-only
            at their absolute paths (its own modules, a data directory); it sees none by default.
    """

    name: str = "single_turn"
    tools: tuple[str, ...] = ()
    tools_path: str = path_field(INPUT_PATH)
    tool_parser: str = "hermes"
    max_turns: int = 4
    tool_concurrency: int = 8
    interaction_path: str = path_field(INPUT_PATH)
    interaction_name: str = "respond"
    tool_timeout_s: float = 60.0
    interaction_timeout_s: float = 60.0
    max_message_chars: int = 32768
    python: SandboxLimits = field(default_factory=SandboxLimits)
    program: str = path_field(INPUT_PATH)
    program_timeout_s: float = 600.0
    program_max_requests: int = 32
    program_max_tokens: int = 8192
    program_command: tuple[str, ...] = ()
    program_output_bytes: int = 16384
    program_sandbox: bool = False
    program_sandbox_mounts: tuple[str, ...] = path_field(INPUT_PATH, ())

    @property
    def enabled(self) -> bool:
        """Whether generation runs episodes (a loop other than ``single_turn``, or tools)."""
        return self.name != "single_turn" or bool(
            self.tools or self.tools_path or self.interaction_path or self.uses_program
        )

    @property
    def uses_program(self) -> bool:
        """Whether an agent program runs the episodes (``agent.program`` or ``agent.program_command``)."""
        return bool(self.program or self.program_command)

    @property
    def program_limits(self) -> ProgramLimits:
        """The limits of one agent program's episode (``agent.program_*``)."""
        return ProgramLimits(
            self.program_timeout_s,
            self.program_max_requests,
            self.program_max_tokens,
            self.program_output_bytes,
            self.python if self.program_sandbox else None,
            self.program_sandbox_mounts,
        )

    def __post_init__(self) -> None:
        if self.name not in AGENT_LOOPS:
            raise ValueError(
                f"agent.name={self.name!r} is not an agent loop; registered: {AGENT_LOOPS.names()}"
            )
        if self.tool_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"agent.tool_parser={self.tool_parser!r} is not a parser; registered: {TOOL_CALL_PARSERS.names()}"
            )
        unknown = sorted(set(self.tools) - set(BUILTIN_TOOLS))
        if unknown:
            raise ValueError(f"agent.tools has {unknown}; the built-in tools are {list(BUILTIN_TOOLS)}")
        for name in (
            "max_turns",
            "tool_concurrency",
            "tool_timeout_s",
            "interaction_timeout_s",
            "max_message_chars",
            "program_timeout_s",
            "program_max_requests",
            "program_max_tokens",
            "program_output_bytes",
        ):
            check_positive("agent", name, getattr(self, name))
        if self.name == "interaction" and not self.interaction_path:
            raise ValueError("agent.name=interaction needs agent.interaction_path (a Python file)")
        if self.name == "program" and not (self.program or self.program_command):
            raise ValueError(
                "agent.name=program needs agent.program (a Python file: async def run(client, row)) "
                "or agent.program_command (a command line as a list: [python,agent.py])"
            )
        if self.program and self.program_command:
            raise ValueError("agent.program and agent.program_command are both set: set one")
        for key in ("program", "program_command"):
            if getattr(self, key) and self.name != "program":
                raise ValueError(f"agent.{key} is set but agent.name={self.name!r}: set agent.name=program")
        if self.program_command:  # a list from the command line: kept as the tuple the field declares
            object.__setattr__(self, "program_command", check_command(self.program_command))
        # a list from the command line or YAML: kept as the tuple the field declares
        object.__setattr__(self, "program_sandbox_mounts", tuple(self.program_sandbox_mounts))
        if self.program_sandbox:
            self._check_program_sandbox()
        elif self.program_sandbox_mounts:
            raise ValueError(
                "agent.program_sandbox_mounts is set but agent.program_sandbox=false: the mounts are "
                "what a sandboxed command sees (an unsandboxed one sees every file)"
            )
        self._check_user_files()

    def _check_program_sandbox(self) -> None:
        if not self.program_command:
            raise ValueError(
                "agent.program_sandbox=true sandboxes agent.program_command, which is not set "
                "(a function program, agent.program, runs inside the run's process)"
            )
        unavailable = sandbox_available()
        if unavailable:
            raise ValueError(f"agent.program_sandbox=true, but the OS sandbox cannot run here: {unavailable}")
        for i, path in enumerate(self.program_sandbox_mounts):
            if not isinstance(path, str) or not os.path.exists(path) or os.path.abspath(path) == "/":
                raise ValueError(
                    f"agent.program_sandbox_mounts[{i}]={path!r} must name an existing file or "
                    "directory other than /"
                )

    def _check_user_files(self) -> None:
        """Load the user's tools and interaction files now: a broken one (a failing import, a
        parameter without a type, ``TOOLS = [42]``, a name given twice, a function that cannot
        take ``(messages, extra_info)``) is then a one-line ``ValueError`` naming the field before
        any model loads, not a worker's traceback after."""
        if self.tools_path:
            names = [*self.tools, *(tool.name for tool in load_user_tools(self.tools_path))]
            duplicates = duplicate_names(names)
            if duplicates:
                raise ValueError(
                    f"agent.tools_path={self.tools_path!r}: tools {duplicates} are declared twice "
                    "(in agent.tools and TOOLS)"
                )
        if self.interaction_path:
            load_interaction(self.interaction_path, self.interaction_name)
        if self.program:
            load_program(self.program)
