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

The episode is **one training row** (:meth:`EpisodeRecord.row`): its segments end to end, each a
sequence of its own. The first segment's prompt is the row's prompt; each later segment's prompt
tokens follow the previous segment in the response columns (``loss_mask`` 0), then its tokens;
``Trajectory.segment_starts`` says where each later segment starts, so the row's positions restart
at 0 there and the trainer computes each token from its own segment only
(:func:`tandem.agents.segments.segment_positions`, :func:`tandem.engine.packing.pack_sequences`).

A request with ``n`` > 1 choices (:meth:`EpisodeRecord.commit_choices`) is decided by the next
one: the choice it echoes continues the row; each other choice becomes a one-turn segment (the
request's context, then its tokens) placed before the segment the row continues with, so the row
still ends with the final answer. With no next request, or one that echoes none, the first choice
continues. Those segments are not splits (:attr:`EpisodeRecord.splits` counts requests that did
not extend the history).

The row's tokens past its prompt (the row's own prompt length, or the first segment's prompt when
shorter) share ``rollout.max_response_length`` (``budget``), all segments together: a system
prompt or tool schemas the program adds, and every later segment's whole prompt, count against
it, so the row always fits the trainer's columns (:func:`fit_prompt_columns`). A request with no
room left is refused (the endpoint's 400, ``max_tokens``), which ends the episode with
``program_error``, as any budget the program runs past does.
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

    def choice_room(self, n: int) -> int:
        """The tokens each of ``n`` choices may sample: the choice the row continues with takes
        its tokens from ``room``, each other one its whole context and its tokens (a segment of
        its own, :meth:`EpisodeRecord.commit_choices`)."""
        return (self.room - (n - 1) * len(self.context_ids)) // n


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
    split_count: int = 0
    pending: tuple[TurnPlan, list[Completion], list[dict]] | None = None  # several choices, undecided

    @property
    def splits(self) -> int:
        """Segments started after the first: requests that did not extend the history."""
        return self.split_count

    def _span(self, index: int, context: int, prompt: int) -> int:
        """The row's response columns that segment ``index`` (``context`` tokens, ``prompt`` of
        them its prompt) takes: all of them but the first segment's row prompt."""
        return context - (min(self.row_prompt, prompt) if index == 0 else 0)

    def _used(self, segments: list[Trajectory]) -> int:
        return sum(self._span(i, len(s.context_ids), len(s.prompt_ids)) for i, s in enumerate(segments))

    def plan(self, messages: list[dict], render_key: str, render) -> TurnPlan:
        """The context of a request with template ``messages`` (rendered the same way as
        ``render_key`` says); ``render()`` gives the template's ids of the whole request, asked
        only when it does not continue the current segment."""
        history = [normalized(m) for m in messages]
        self._settle(history)
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
            index = len(self.segments) - 1
            used = self._used(self.segments[:-1]) + self._span(index, len(context), len(segment.prompt_ids))
            return TurnPlan(context, appended, self.budget - used, history, render_key, messages)
        context = tuple(render())
        used = self._used(self.segments) + self._span(len(self.segments), len(context), len(context))
        return TurnPlan(context, None, self.budget - used, history, render_key, messages)

    def commit(self, plan: TurnPlan, completion: Completion, reply: dict) -> None:
        """Record the sampled turn of ``plan`` and the assistant message ``reply`` returned for it."""
        self._record(plan, completion, reply)
        self.sampled += len(completion.token_ids)

    def commit_choices(self, plan: TurnPlan, completions: list[Completion], replies: list[dict]) -> None:
        """Record the choices of ``plan`` (a request with ``n`` > 1) and their replies: the one the
        next request echoes continues the row, each other one becomes a segment of its own (its
        context and its tokens), all under the episode's reward. Decided by the next
        :meth:`plan`, or by :meth:`row` when no request follows (the first choice continues then,
        as it does when the next request echoes none)."""
        if len(completions) == 1:
            self.commit(plan, completions[0], replies[0])
            return
        self.pending = (plan, list(completions), list(replies))
        self.sampled += sum(len(c.token_ids) for c in completions)
        self.conversation = [*plan.messages, {**replies[0], "content": replies[0].get("content") or ""}]

    def _settle(self, history: list[dict] | None) -> None:
        """Decide the pending choices (:meth:`commit_choices`) by the ``history`` of the next
        request (None: there is none)."""
        if self.pending is None:
            return
        plan, completions, replies = self.pending
        self.pending = None
        echoed = [
            k for k, reply in enumerate(replies)
            if history is not None and history[: len(plan.history) + 1] == [*plan.history, normalized(reply)]
        ]  # fmt: skip
        chosen = echoed[0] if echoed else 0
        others = []
        for k, completion in enumerate(completions):
            if k != chosen:
                others.append(Trajectory(plan.context_ids))
                others[-1].add_model_turn(completion)
                others[-1].finish_reason = completion.finish_reason or "stop"
        self._record(plan, completions[chosen], replies[chosen])
        self.segments[-1:-1] = others  # before the segment the row continues with

    def _record(self, plan: TurnPlan, completion: Completion, reply: dict) -> None:
        if plan.appended is None:
            self.split_count += bool(self.segments)
            self.segments.append(Trajectory(plan.context_ids))
        else:
            self.segments[-1].add_other_turn(plan.appended)
        self.segments[-1].add_model_turn(completion)
        self.segments[-1].finish_reason = completion.finish_reason or "stop"
        self.history = [*plan.history, normalized(reply)]
        self.conversation = [*plan.messages, {**reply, "content": reply.get("content") or ""}]
        self.render_key = plan.render_key

    def row(self, prompt: tuple[int, ...]) -> Trajectory:
        """The episode as one training row (see the module docstring): its segments end to end,
        each later one's prompt masked out (``loss_mask`` 0) where it starts; ``prompt`` (the
        row's own rendering) when the program made no request. Its finish reason is the last
        segment's; its turns are all segments' turns."""
        self._settle(None)
        if not self.segments:
            return Trajectory(prompt, finish_reason="stop")
        first = self.segments[0]
        row = Trajectory(first.prompt_ids)
        for index, segment in enumerate(self.segments):
            if index:
                row.segment_starts.append(len(row.token_ids))
                row.add_other_turn(list(segment.prompt_ids))
            row.token_ids += segment.token_ids
            row.loss_mask += segment.loss_mask
            row.log_probs += segment.log_probs
            row.weight_versions += segment.weight_versions
            row.turns += segment.turns
        row.finish_reason = self.segments[-1].finish_reason
        row.splits = self.splits
        return row


def fit_prompt_columns(trajectory: Trajectory, prompt_width: int) -> Trajectory:
    """``trajectory`` laid out for ``prompt_width`` prompt columns: a longer prompt's tokens past
    them move to the front of the response, ``loss_mask`` 0 (the sequence itself is unchanged,
    so the trainer's log-probs of the sampled tokens are too). A training draw's rows have room
    for the whole prompt (``rollout.max_response_length`` more columns than the dataset's prompts:
    :func:`tandem.rl.batch_source.stored_prompt_width`); validation's and greedy baselines' are
    laid out at the batch's widest prompt, where this moves tokens."""
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
    moved.segment_starts = [start + extra for start in trajectory.segment_starts]
    moved.add_other_turn(list(trajectory.prompt_ids[prompt_width:]))
    moved.token_ids += trajectory.token_ids
    moved.loss_mask += trajectory.loss_mask
    moved.log_probs += trajectory.log_probs
    moved.weight_versions += trajectory.weight_versions
    return moved
