"""``AgentConfig``: the agent loop, its tools and its limits (``agent.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.agents.sandbox import SandboxLimits
from tandem.config.validation import check_positive

BUILTIN_TOOLS = ("calculator", "python")


@dataclass(frozen=True)
class AgentConfig:
    """How episodes run (``agent.*``).

    Attributes:
        name: the loop for samples without an ``agent_name`` column: ``single_turn`` (one
            response), ``tool_agent`` (generate, run the tool calls, append the results, until
            an answer without calls, ``max_turns`` or the response budget) or ``interaction``
            (a user function replies after each turn and may end the episode with a reward).
        tools: built-in tools to offer (``calculator``, ``python``).
        tools_path: a Python file whose ``TOOLS`` list adds user tools.
        tool_parser: how tool calls are read from the model's text (``hermes``:
            ``<tool_call>{json}</tool_call>``).
        max_turns: model turns per episode at most.
        tool_concurrency: tool calls running at once, across every episode.
        interaction_path / interaction_name: the file and function of the ``interaction`` loop:
            ``fn(messages, extra_info) -> {"content": str | None, "done": bool, "reward": float | None}``.
        python: the sandbox limits of the ``python`` tool.
    """

    name: str = "single_turn"
    tools: tuple[str, ...] = ()
    tools_path: str = ""
    tool_parser: str = "hermes"
    max_turns: int = 4
    tool_concurrency: int = 8
    interaction_path: str = ""
    interaction_name: str = "respond"
    python: SandboxLimits = field(default_factory=SandboxLimits)

    @property
    def enabled(self) -> bool:
        """Whether generation runs episodes (a loop other than ``single_turn``, or tools)."""
        return self.name != "single_turn" or bool(self.tools or self.tools_path or self.interaction_path)

    def __post_init__(self) -> None:
        from tandem.agents.loops import AGENT_LOOPS
        from tandem.agents.tool_calls import TOOL_CALL_PARSERS

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
        check_positive("agent", "max_turns", self.max_turns)
        check_positive("agent", "tool_concurrency", self.tool_concurrency)
        if self.name == "interaction" and not self.interaction_path:
            raise ValueError("agent.name=interaction needs agent.interaction_path (a Python file)")
