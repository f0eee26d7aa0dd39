"""An agent program's requests recorded as token-exact training rows.

Each request's messages are compared with the episode's history: the messages of its previous
request followed by the assistant message that request returned (content and tool calls as the
endpoint sent them). When the new messages begin with that history, under the same ``tools``
and template settings, the request **continues** the current segment: its context is the
segment's tokens as sampled — never the assistant text re-tokenised — followed by the template
tokens of the new messages (:class:`~tandem.agents.trajectory.TurnEncoder`; an end-of-turn
token first when the model's turn did not end with one, as after ``length`` or a stop string).
Otherwise (the program rewrote, summarised or branched its history) the request starts a new
**segment** from the chat template's rendering of its messages, and the episode counts a split.
A segment is one :class:`~tandem.agents.trajectory.Trajectory`: the prompt, then every token,
``loss_mask`` 1 on the sampled ones.

A segment's tokens past its row's prompt (the row's own prompt length, or the segment's prompt
when shorter) share ``rollout.max_response_length`` (``budget``): a system prompt or tool schemas
the program adds count against it, so the row always fits the trainer's columns
(:func:`fit_prompt_columns`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

from tandem.agents.trajectory import Trajectory, TurnEncoder
from tandem.protocol.generation import Completion


def normalized(message: dict) -> dict:
    """The parts of a chat message that decide its rendering, in one form: ``content`` as text
    (``None`` is ``""``), an assistant's ``tool_calls`` as ``(name, arguments)`` with the arguments
    parsed (ids and the ``type`` wrapper dropped: clients echo them in varying shapes)."""
    out = {"role": message.get("role"), "content": message.get("content") or ""}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [_call_key(call) for call in calls]
    return out


def _call_key(call: object) -> tuple[str, str]:
    """``(name, arguments as canonical JSON)`` of an OpenAI tool call (or the raw value's repr)."""
    if not isinstance(call, dict):
        return ("", repr(call))
    function = call.get("function", call)
    arguments = function.get("arguments", {}) if isinstance(function, dict) else {}
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: compared as the string it is
            arguments = json.loads(arguments)
    name = function.get("name", "") if isinstance(function, dict) else ""
    return (str(name), json.dumps(arguments, sort_keys=True))


@dataclass
class TurnPlan:
    """What one request is sampled from: the whole context, the template tokens it appends to the
    current segment (continuing) or None (a new segment whose prompt is ``context_ids``), and the
    tokens the model may still sample in this row."""

    context_ids: tuple[int, ...]
    appended: list[int] | None
    room: int
    history: list[dict]
    render_key: str
    messages: list[dict]


@dataclass
class EpisodeRecord:
    """The segments of one episode (see the module docstring); ``row_prompt`` is the length of the
    row's own rendered prompt, ``budget`` the response columns of a row."""

    encoder: TurnEncoder
    end_of_turn: int
    row_prompt: int
    budget: int
    segments: list[Trajectory] = field(default_factory=list)
    history: list[dict] | None = None
    conversation: list[dict] = field(default_factory=list)  # the last request's messages and reply
    render_key: str = ""
    requests: int = 0
    sampled: int = 0

    @property
    def splits(self) -> int:
        """Segments started after the first: requests that did not extend the history."""
        return max(len(self.segments) - 1, 0)

    def plan(self, messages: list[dict], render_key: str, render) -> TurnPlan:
        """The context of a request with template ``messages`` (rendered the same way as
        ``render_key`` says); ``render()`` gives the template's ids of the whole request, asked
        only when it does not continue the current segment."""
        history = [normalized(m) for m in messages]
        previous = self.history
        if (
            self.segments
            and previous is not None
            and render_key == self.render_key
            and history[: len(previous)] == previous
        ):
            segment = self.segments[-1]
            closing = [] if segment.token_ids[-1:] == [self.end_of_turn] else [self.end_of_turn]
            appended = closing + self.encoder.encode(messages[len(previous) :])
            context = segment.context_ids + tuple(appended)
            start = min(self.row_prompt, len(segment.prompt_ids))
            room = self.budget - (len(context) - start)
            return TurnPlan(context, appended, room, history, render_key, messages)
        context = tuple(render())
        start = min(self.row_prompt, len(context))
        return TurnPlan(context, None, self.budget - (len(context) - start), history, render_key, messages)

    def commit(self, plan: TurnPlan, completion: Completion, reply: dict) -> None:
        """Record the sampled turn of ``plan`` and the assistant message ``reply`` returned for it."""
        if plan.appended is None:
            self.segments.append(Trajectory(plan.context_ids))
        else:
            self.segments[-1].add_other_turn(plan.appended)
        self.segments[-1].add_model_turn(completion)
        self.segments[-1].finish_reason = completion.finish_reason or "stop"
        self.history = [*plan.history, normalized(reply)]
        self.conversation = [*plan.messages, {**reply, "content": reply.get("content") or ""}]
        self.render_key = plan.render_key
        self.sampled += len(completion.token_ids)


def fit_prompt_columns(trajectory: Trajectory, prompt_width: int) -> Trajectory:
    """``trajectory`` laid out for ``prompt_width`` prompt columns: a longer prompt's tokens past
    them move to the front of the response, ``loss_mask`` 0 (the sequence itself is unchanged,
    so the trainer's log-probs of the sampled tokens are too)."""
    extra = len(trajectory.prompt_ids) - prompt_width
    if extra <= 0:
        return trajectory
    moved = Trajectory(trajectory.prompt_ids[:prompt_width], **{
        name: getattr(trajectory, name)
        for name in (
            "messages", "finish_reason", "turns", "tool_calls", "tool_errors", "reward", "splits", "metrics",
            "program_log",
        )
    })  # fmt: skip
    moved.add_other_turn(list(trajectory.prompt_ids[prompt_width:]))
    moved.token_ids += trajectory.token_ids
    moved.loss_mask += trajectory.loss_mask
    moved.log_probs += trajectory.log_probs
    moved.weight_versions += trajectory.weight_versions
    return moved
