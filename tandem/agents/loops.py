"""Agent loops, registered by name in ``AGENT_LOOPS``, and :func:`run_episodes` that runs many at once.

A loop is ``async def loop(ctx, sample) -> Trajectory``: it asks ``ctx.generator`` for model
turns (token ids in, token ids out) and builds the trajectory with
:mod:`tandem.agents.trajectory`. The whole episode's response — model turns and the tool or
user turns between them — shares one budget of ``ctx.sampling.max_tokens`` tokens.

* ``single_turn``: one response (what RL does without agents).
* ``tool_agent``: the model's turn is parsed for tool calls (``ctx.parser``); calls run
  (``ctx.tools``, in parallel within a turn and at most ``agent.tool_concurrency`` across
  episodes) and their results — or the errors of malformed calls, unknown tools and bad
  arguments — return as ``tool`` messages; the episode ends at a turn without calls
  (``stop``), at ``agent.max_turns`` (``max_turns``) or when the budget runs out (``length``).
* ``program``: the user's own agent program drives the episode through an OpenAI-compatible
  endpoint (``ctx.program``, :mod:`tandem.agents.program`); its return value is the reward.
* ``interaction``: after each model turn a user function replies (a ``user`` message) or ends
  the episode, optionally with a reward. A function that raises (``SystemExit`` included), runs
  past ``ctx.interaction_timeout_s`` or replies malformed (not a dict, ``content`` not text, a
  reward that is not a finite number) ends the episode with ``interaction_error`` and reward 0.

Every tool result and user reply is cut to ``ctx.max_message_chars`` characters before it is
tokenised (:func:`cut_text`): a tool that returns megabytes costs nothing beyond that.

Write a new loop as an async function taking ``(ctx, sample)`` and register it with
``@AGENT_LOOPS.register("name")``; samples pick it with an ``agent_name`` column.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import statistics
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.agents.generators import TokenGenerator
from tandem.agents.tool_calls import ToolCallParser
from tandem.agents.tools import ToolRunner, tool_metrics
from tandem.agents.trajectory import Trajectory, TurnEncoder
from tandem.config.user_code import load_user_function
from tandem.config.user_values import describe, real_number
from tandem.models.chat import template_ids, with_image_parts
from tandem.models.vision import ImagePrompter, expand_image_tokens
from tandem.protocol.generation import Completion, SamplingParams
from tandem.protocol.images import ImageInputs
from tandem.registry import Registry
from tandem.user_calls import UserCodeError, describe_error, start_user_call

TURN_SEED_STRIDE = 1_000_003  # turn t of an episode samples with seed + t * stride
INTERACTION_ERROR = "interaction_error"  # the finish reason of an episode whose interaction failed
PROGRAM_ERROR = "program_error"  # the finish reason of an episode whose agent program failed
LOG = logging.getLogger(__name__)
MAX_REPORTED = 100  # distinct interaction failures logged per context; the metric counts them all


@dataclass
class AgentSample:
    """One episode to run: the prompt as chat messages, its seed and id, the row's
    ``extra_info`` (for interactions), the loop to use (empty: the context's default), and a
    vision-language prompt's images (the first user turn's ``<image>`` placeholders, in order)."""

    messages: list[dict]
    seed: int
    request_id: str
    extra_info: dict = field(default_factory=dict)
    agent_name: str = ""
    images: ImageInputs | None = None


@dataclass
class AgentContext:
    """What every loop may use: the model, the tokenizer, the sampling settings (``max_tokens``:
    the episode's response budget), tools, parser, the turn limit, an interaction, the seconds
    one interaction call may take and the characters kept of each tool result or user reply."""

    generator: TokenGenerator
    tokenizer: Any
    sampling: SamplingParams
    default_loop: str = "single_turn"
    max_turns: int = 4
    tools: ToolRunner | None = None
    parser: ToolCallParser | None = None
    interaction: Callable[[list[dict], dict], dict] | None = None
    interaction_timeout_s: float = 60.0
    max_message_chars: int = 32768
    prompter: ImagePrompter | None = None
    program: EpisodeProgram | None = None  # the ``program`` loop's runner (agent.program)
    encoder: TurnEncoder = field(init=False)
    reported: set[str] = field(init=False, default_factory=set)  # interaction failures already logged

    def __post_init__(self) -> None:
        self.encoder = TurnEncoder(self.tokenizer)

    def prompt_ids(self, messages: list[dict], images: ImageInputs | None = None) -> tuple[int, ...]:
        """The first prompt: the messages with the tools' schemas, rendered by the chat template;
        with ``images``, the messages' ``<image>`` placeholders become image parts and each image
        token a placeholder token (the episode's every turn sends the images with its context)."""
        tools = self.tools.schemas() if self.tools is not None else None
        if images is None:
            return tuple(template_ids(self.tokenizer, messages, add_generation_prompt=True, tools=tools))
        if self.prompter is None:
            raise ValueError("an agent episode has images, but the model has no vision tower")
        parts, _ = with_image_parts(messages)
        ids = template_ids(self.tokenizer, parts, add_generation_prompt=True, tools=tools)
        return tuple(expand_image_tokens(ids, images, self.prompter.placeholder, self.prompter.merge))


class EpisodeProgram(Protocol):
    """Runs one episode of an agent program (:class:`~tandem.agents.program.runner.ProgramRunner`)."""

    async def run_episode(self, ctx: AgentContext, sample: AgentSample) -> Trajectory: ...


class AgentError(RuntimeError):
    """A model turn failed in the engine or server (the episode cannot go on)."""


AgentLoop = Callable[[AgentContext, AgentSample], Awaitable[Trajectory]]
AGENT_LOOPS: Registry[AgentLoop] = Registry("agent loop")


def turn_request_id(episode_id: str, turn: int) -> str:
    """The engine request id of an episode's ``turn``-th model turn."""
    return f"{episode_id}-turn{turn}"


async def model_turn(ctx: AgentContext, sample: AgentSample, trajectory: Trajectory) -> Completion | None:
    """Sample the next model turn into ``trajectory`` (and its decoded text into ``messages``);
    ``None`` when no budget is left (the trajectory then ends with ``length``)."""
    remaining = ctx.sampling.max_tokens - len(trajectory.token_ids)
    if remaining <= 0:
        trajectory.finish_reason = "length"
        return None
    params = dataclasses.replace(
        ctx.sampling, max_tokens=remaining, seed=sample.seed + trajectory.turns * TURN_SEED_STRIDE
    )
    pictures = {"images": sample.images} if sample.images is not None else {}  # text: any generator works
    completion = await ctx.generator.generate(
        trajectory.context_ids, params, turn_request_id(sample.request_id, trajectory.turns), **pictures
    )
    if completion.finish_reason == "error":
        raise AgentError(f"episode {sample.request_id}, turn {trajectory.turns}: {completion.error}")
    trajectory.add_model_turn(completion)
    text = ctx.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    trajectory.messages.append({"role": "assistant", "content": text})
    trajectory.finish_reason = completion.finish_reason or "stop"
    return completion


def cut_text(text: str, limit: int) -> str:
    """``text`` when it has at most ``limit`` characters; else its first and last ``limit / 2``
    with a note of how many were cut between them (a listing's start and a traceback's end both
    stay)."""
    if len(text) <= limit:
        return text
    head = limit // 2
    note = f"[... {len(text) - limit} characters cut (agent.max_message_chars={limit}) ...]"
    return f"{text[:head]}\n{note}\n{text[len(text) - (limit - head) :]}"


def append_turns(ctx: AgentContext, trajectory: Trajectory, messages: list[dict]) -> bool:
    """Append non-model ``messages`` as template tokens, each text first cut to
    ``ctx.max_message_chars`` (:func:`cut_text`); False (and ``length``) when they do not fit in
    the budget with room for another model token. A model turn that stopped without the
    end-of-turn token (on a stop string or another stop id) is closed with it first, as the chat
    template renders the turn (and as the program endpoint does)."""
    messages = [
        {**message, "content": cut_text(message["content"], ctx.max_message_chars)}
        if isinstance(message.get("content"), str)
        else message
        for message in messages
    ]
    end = ctx.encoder.end_id
    tokens = ([] if trajectory.token_ids[-1:] == [end] else [end]) + ctx.encoder.encode(messages)
    trajectory.messages += messages
    if len(trajectory.token_ids) + len(tokens) >= ctx.sampling.max_tokens:
        trajectory.finish_reason = "length"
        return False
    trajectory.add_other_turn(tokens)
    return True


@AGENT_LOOPS.register("single_turn")
async def single_turn(ctx: AgentContext, sample: AgentSample) -> Trajectory:
    """One model turn."""
    trajectory = Trajectory(ctx.prompt_ids(sample.messages, sample.images), messages=list(sample.messages))
    await model_turn(ctx, sample, trajectory)
    return trajectory


@AGENT_LOOPS.register("tool_agent")
async def tool_agent(ctx: AgentContext, sample: AgentSample) -> Trajectory:
    """Generate, call tools, append their results, until an answer (see the module docstring)."""
    if ctx.tools is None or ctx.parser is None:
        raise ValueError(
            "the tool_agent loop needs tools and a tool-call parser (agent.tools / agent.tools_path)"
        )
    trajectory = Trajectory(ctx.prompt_ids(sample.messages, sample.images), messages=list(sample.messages))
    for _ in range(ctx.max_turns):
        completion = await model_turn(ctx, sample, trajectory)
        if completion is None or trajectory.finish_reason != "stop":
            return trajectory
        turn = ctx.parser(trajectory.messages[-1]["content"])
        if not turn.calls and not turn.errors:
            return trajectory  # an answer: the episode is done
        results = await asyncio.to_thread(ctx.tools.run, turn.calls) if turn.calls else []
        trajectory.tool_calls += len(turn.calls)
        trajectory.tool_errors += len(turn.errors) + sum(result.startswith("error:") for result in results)
        replies = [f"error: {error}" for error in turn.errors] + results
        if not append_turns(ctx, trajectory, [{"role": "tool", "content": reply} for reply in replies]):
            return trajectory
    trajectory.finish_reason = "max_turns"
    return trajectory


@AGENT_LOOPS.register("program")
async def program(ctx: AgentContext, sample: AgentSample) -> Trajectory:
    """The user's agent program runs the episode (see the module docstring)."""
    if ctx.program is None:
        raise ValueError("the program loop needs agent.program (a Python file: async def run(client, row))")
    return await ctx.program.run_episode(ctx, sample)


@AGENT_LOOPS.register("interaction")
async def interaction(ctx: AgentContext, sample: AgentSample) -> Trajectory:
    """Model and user function take turns; the function ends the episode (with a reward)."""
    if ctx.interaction is None:
        raise ValueError("the interaction loop needs agent.interaction_path")
    trajectory = Trajectory(ctx.prompt_ids(sample.messages, sample.images), messages=list(sample.messages))
    for _ in range(ctx.max_turns):
        completion = await model_turn(ctx, sample, trajectory)
        if completion is None or trajectory.finish_reason != "stop":
            return trajectory
        reply = await interaction_reply(ctx, sample, trajectory)
        if reply is None:  # the function failed: the episode ends, scored 0 by the interaction
            trajectory.finish_reason, trajectory.reward = INTERACTION_ERROR, 0.0
            return trajectory
        if reply.reward is not None:
            trajectory.reward = reply.reward
        if reply.done or reply.content is None:
            return trajectory
        if not append_turns(ctx, trajectory, [{"role": "user", "content": reply.content}]):
            return trajectory
    trajectory.finish_reason = "max_turns"
    return trajectory


@dataclass(frozen=True)
class InteractionReply:
    """An interaction's checked reply: the user's next message (None: the episode ends), whether
    the episode ends, and the reward it ends with (a finite number, or None)."""

    content: str | None
    done: bool
    reward: float | None


def read_reply(reply: object) -> InteractionReply:
    """``reply`` checked against ``{"content": str | None, "done": bool, "reward": float | None}``;
    ``ValueError`` saying what is wrong otherwise (a NaN or infinite reward would poison the loss)."""
    if not isinstance(reply, dict):
        raise ValueError(f"returned {type(reply).__name__}, not a dict with 'content', 'done' and 'reward'")
    content, reward = reply.get("content"), reply.get("reward")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"returned 'content' of type {type(content).__name__}, not text or None")
    number = None if reward is None else real_number(reward)
    if reward is not None and number is None:
        raise ValueError(f"returned a 'reward' that is {describe(reward)}, not a finite number or None")
    return InteractionReply(content, bool(reply.get("done")), number)


async def interaction_reply(
    ctx: AgentContext, sample: AgentSample, trajectory: Trajectory
) -> InteractionReply | None:
    """The interaction's checked reply to the conversation so far; None when the function raised,
    ran past ``ctx.interaction_timeout_s`` or replied malformed (logged: each distinct failure
    once, the first ``MAX_REPORTED`` of them). It runs on a thread of its own
    (:func:`~tandem.user_calls.start_user_call`): one that never returns holds neither the
    event loop nor a worker that other episodes wait for."""
    call = start_user_call(ctx.interaction, list(trajectory.messages), sample.extra_info)
    try:
        return read_reply(await asyncio.wait_for(asyncio.wrap_future(call), ctx.interaction_timeout_s))
    except asyncio.TimeoutError:
        problem = f"did not return within {ctx.interaction_timeout_s:g} s (agent.interaction_timeout_s)"
    except UserCodeError as error:
        problem = f"raised {error}"
    except ValueError as error:  # read_reply's checks
        problem = str(error)
    except Exception as error:  # a reply whose truth value raises, say
        problem = f"replied with something unreadable ({describe_error(error)})"
    if problem not in ctx.reported and len(ctx.reported) < MAX_REPORTED:
        ctx.reported.add(problem)
        LOG.warning(
            "the interaction function %s (episode %s; the episode ends with reward 0, counted in "
            "agent/interaction/errors; this failure is not logged again)", problem, sample.request_id,
        )  # fmt: skip
    return None


def load_interaction(path: str, name: str) -> Callable[[list[dict], dict], dict]:
    """The function ``name`` of the file at ``path`` (``agent.interaction_name`` and
    ``agent.interaction_path``), checked to take ``(messages, extra_info)``: a ``ValueError``
    naming the field for a file that fails to import or a function that does not fit."""
    function = load_user_function(path, name, "agent.interaction_path", "agent.interaction_name")
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        raise ValueError(
            f"agent.interaction_path={path!r}: function {name!r} (agent.interaction_name) must take "
            "two arguments (messages, extra_info)"
        ) from None
    except ValueError:  # a callable without a signature to inspect: its first call will tell
        pass
    return function


def run_episode(ctx: AgentContext, sample: AgentSample) -> Awaitable[Trajectory]:
    """The sample's episode, with its loop (the row's ``agent_name`` or the context's default)."""
    return AGENT_LOOPS.get(sample.agent_name or ctx.default_loop)(ctx, sample)


def run_episodes(ctx: AgentContext, samples: list[AgentSample]) -> list[Trajectory]:
    """Every sample's episode, all in flight at once; in the samples' order."""

    async def run_all() -> list[Trajectory]:
        return await asyncio.gather(*(run_episode(ctx, sample) for sample in samples))

    return asyncio.run(run_all())


class EpisodeThread:
    """An asyncio loop on a thread of its own, for episodes that start and end at any time (a
    rollout replica's): :meth:`submit` returns a ``concurrent.futures.Future`` of the trajectory."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._loop.set_exception_handler(self._report)
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-episodes", daemon=True)
        self._thread.start()

    def submit(self, ctx: AgentContext, sample: AgentSample) -> Future:
        return asyncio.run_coroutine_threadsafe(run_episode(ctx, sample), self._loop)

    def close(self) -> None:
        """Stop the loop; episodes still running (aborted ones between turns) are abandoned."""
        self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5.0)

    def _report(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The loop's error reports, but not the abandoned episodes' "destroyed while pending"."""
        if not self._closed:
            loop.default_exception_handler(context)


def agent_metrics(trajectories: list[Trajectory], tools: ToolRunner | None = None) -> dict[str, float]:
    """:func:`episode_metrics` of ``trajectories`` and ``tools``' counters."""
    return episode_metrics(
        [t.turns for t in trajectories],
        [t.tool_calls for t in trajectories],
        [t.tool_errors for t in trajectories],
        [t.finish_reason for t in trajectories],
        [tools.stats.totals()] if tools is not None else [],
    )


def batch_episode_metrics(
    batch: Any, tool_totals: Callable[[], list[dict[str, tuple[int, int, float]]]]
) -> dict[str, float]:
    """:func:`episode_metrics` of a step's rows (a ``Batch`` holding ``agent_turns``, ...) and the
    workers' tool counters (``tool_totals()``, asked only for agent episodes); empty when the
    rows are no agent episodes."""
    if "agent_turns" not in batch:
        return {}
    return episode_metrics(
        batch["agent_turns"],
        batch["agent_tool_calls"],
        batch["agent_tool_errors"],
        batch["finish_reason"],
        tool_totals(),
        program_splits=batch.get("agent_program_splits", ()),
        program_metrics=batch.get("agent_program_metrics", ()),
    )


def episode_metrics(
    turns: Sequence[int],
    tool_calls: Sequence[int],
    tool_errors: Sequence[int],
    finish_reasons: Sequence[str],
    tool_totals: list[dict[str, tuple[int, int, float]]],
    program_splits: Sequence[int] = (),
    program_metrics: Sequence[dict[str, float]] = (),
) -> dict[str, float]:
    """``agent/turns/mean``, ``agent/tool_calls/mean``, ``agent/tool/errors`` (malformed calls
    included), ``agent/interaction/errors`` (episodes whose interaction failed),
    ``agent/program/errors`` (episodes whose agent program failed), ``agent/program/splits``
    (given ``program_splits``: new segments, summed over the episodes), the mean of each metric
    the programs returned over the episodes that returned it (``agent/program/metric/<name>``,
    from ``program_metrics``: a failed episode returns none), the share of
    episodes per finish reason (``agent/finish/<reason>``), and per tool
    ``agent/tool/<name>/{calls,errors,latency_s}`` from the workers' :meth:`ToolStats.totals`."""
    metrics = {
        **tool_metrics(tool_totals),
        "agent/turns/mean": statistics.fmean(turns),
        "agent/tool_calls/mean": statistics.fmean(tool_calls),
        "agent/tool/errors": float(sum(tool_errors)),
        "agent/interaction/errors": float(sum(reason == INTERACTION_ERROR for reason in finish_reasons)),
        "agent/program/errors": float(sum(reason == PROGRAM_ERROR for reason in finish_reasons)),
    }
    if len(program_splits):  # a column of the batch may be an array
        metrics["agent/program/splits"] = float(sum(program_splits))
    reported: dict[str, list[float]] = {}
    for returned in program_metrics:
        for name, value in (returned or {}).items():
            reported.setdefault(name, []).append(value)
    for name, values in reported.items():
        metrics[f"agent/program/metric/{name}"] = statistics.fmean(values)
    for reason, count in Counter(finish_reasons).items():
        metrics[f"agent/finish/{reason}"] = count / len(finish_reasons)
    return metrics
