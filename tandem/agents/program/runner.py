"""Running agent programs as episodes: :class:`ProgramRunner` is the ``program`` loop's
``ctx.program`` (:mod:`tandem.agents.loops`).

Each episode gets a key on the endpoint (started on first use, on a thread of its own) and the
row ``{"messages", "extra_info", "seed"}``. A function program (``agent.program``) is called with
a ready ``openai.AsyncOpenAI`` client with that key (no retries: a refused request is the
program's to handle) on the episodes' event loop under ``agent.program_timeout_s``; it must not
block that loop (its requests are awaited, not run on threads). A command
(``agent.program_command``) runs as a subprocess per episode
(:mod:`~tandem.agents.program.command`). When the program is done, the episode ends (its key
then gets 409) and the recording becomes the trajectory: **one training row** holding every
segment end to end, each its own sequence (:meth:`~tandem.agents.program.recorder.EpisodeRecord.row`),
all under the episode's reward; a split episode's new segments are counted (``Trajectory.splits``).

:meth:`ProgramRunner.abort` ends a running episode from another thread (a replica's shutdown,
:meth:`~tandem.agents.rollout.AgentRollout.abort_episode`): its trajectory finishes with
``abort``, which the replica drops.

A program that raises (a command: exits non-zero, prints no result, writes past its output
cap), times out, returns something that is not a reward, ends while a request of it is still being
answered (the request is aborted and not recorded), or made a request that was refused
(malformed, over a limit) ends its episode with ``program_error`` and reward 0 (each distinct
problem logged once). The trajectory's ``program_log`` keeps the reason and the program's output: a
command's stdout/stderr, or what a function printed while its episode ran
(:mod:`~tandem.agents.program.captured_output`), each capped at ``agent.program_output_bytes``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import ssl
import threading
from collections.abc import Sequence

import openai

from tandem.agents.loops import PROGRAM_ERROR, AgentContext, AgentSample
from tandem.agents.program.captured_output import captured_output
from tandem.agents.program.command import run_command
from tandem.agents.program.config import ProgramLimits, load_program, read_result
from tandem.agents.program.endpoint import Episode, ProgramEndpoint
from tandem.agents.program.recorder import EpisodeRecord
from tandem.agents.tool_calls import ToolCallParser
from tandem.agents.trajectory import Trajectory
from tandem.models.chat import template_ids
from tandem.serve.launch import AppThread
from tandem.user_calls import describe_error

LOG = logging.getLogger(__name__)
MAX_REPORTED = 100  # distinct program failures logged; the metric counts them all


class ProgramRunner:
    """Episodes of the program ``spec`` (``agent.program``) or the command ``command``
    (``agent.program_command``: given, ``spec`` is ignored) over ``engine`` (see the module
    docstring)."""

    def __init__(
        self, spec: str, limits: ProgramLimits, engine, tokenizer, parser: ToolCallParser | None,
        command: Sequence[str] = (),
    ) -> None:  # fmt: skip
        self.command = tuple(command)
        self.function = None if self.command else load_program(spec)
        self.spec = " ".join(self.command) if self.command else spec
        self.limits, self.tokenizer = limits, tokenizer
        self.endpoint = ProgramEndpoint(engine, tokenizer, parser)
        self.server: AppThread | None = None
        self.reported: set[str] = set()
        self.running: dict[str, Episode] = {}  # episode name -> its endpoint episode, while it runs
        self.aborted: set[str] = set()  # names of running episodes that :meth:`abort` ended
        self.lock = threading.Lock()  # running, aborted: abort() comes from the replica's thread
        # one TLS context for every episode's client: building one loads the CA bundle (~0.1 s
        # under load, about half an episode's cost); the endpoint is plain HTTP, so it never verifies
        self.tls = ssl.create_default_context()

    @property
    def base_url(self) -> str:
        """The endpoint's ``/v1`` URL (the endpoint starts on first use)."""
        if self.server is None:
            self.server = AppThread(self.endpoint.app, name="tandem-agent-programs").start()
        return self.server.url + "/v1"

    async def run_episode(self, ctx: AgentContext, sample: AgentSample) -> Trajectory:
        """Run the program on ``sample``'s row; its trajectory (see the module docstring)."""
        prompt = tuple(template_ids(ctx.tokenizer, sample.messages, add_generation_prompt=True))
        record = EpisodeRecord(
            ctx.encoder, self.tokenizer.convert_tokens_to_ids(self.tokenizer.eos_token),
            len(prompt), ctx.sampling.max_tokens,
        )  # fmt: skip
        episode = self.endpoint.open(sample.request_id, record, self.limits, ctx.sampling, sample.seed)
        with self.lock:
            self.running[sample.request_id] = episode
        row = {"messages": copy.deepcopy(sample.messages), "extra_info": copy.deepcopy(sample.extra_info),
               "seed": sample.seed}  # fmt: skip
        result, output = None, {"stdout": "", "stderr": ""}
        try:
            if self.command:
                run = await run_command(self.command, row, self.base_url, episode.key, self.limits)
                value, problem, output = run.value, run.problem, {"stdout": run.stdout, "stderr": run.stderr}
            else:
                with captured_output(self.limits.output_bytes) as printed:
                    value, problem = await self._call_function(episode, row)
                output = printed.texts()
        finally:
            unfinished = self.endpoint.close(episode)  # its first close counts (a function's: below)
            with self.lock:
                self.running.pop(sample.request_id, None)
                aborted = sample.request_id in self.aborted
                self.aborted.discard(sample.request_id)
        if aborted:
            return self._aborted(sample, prompt, record)
        if not problem:
            try:
                result = read_result(value)
            except ValueError as error:
                problem = str(error)
        if unfinished > 0 and not problem:
            problem = (
                f"ended with {unfinished} request{'s' if unfinished > 1 else ''} still being answered "
                "(aborted, not recorded): a program must await its requests' answers before it ends"
            )
        if episode.error and not problem:
            problem = f"made a request that was refused ({episode.error})"
        return self._trajectory(sample, prompt, record, result, problem, output)

    async def _call_function(self, episode: Episode, row: dict) -> tuple[object, str]:
        """The function program's return value and its fault (empty: none). Its episode ends as
        the function does, before its client closes: a request the function left open is then
        still being answered (``unfinished``), not a client that went away."""
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=episode.key, max_retries=0, timeout=self.limits.timeout_s,
            http_client=openai.DefaultAsyncHttpxClient(verify=self.tls),
        )  # fmt: skip
        try:
            return await asyncio.wait_for(self.function(client, row), self.limits.timeout_s), ""
        except asyncio.TimeoutError:
            return None, f"did not return within {self.limits.timeout_s:g} s (agent.program_timeout_s)"
        except (Exception, SystemExit) as error:  # user code may raise anything, SystemExit too
            return None, f"raised {describe_error(error)}"
        finally:
            self.endpoint.close(episode)
            await client.close()

    def abort(self, name: str) -> None:
        """End the running episode ``name`` now (a replica's shutdown): its requests in the engine
        are aborted, later ones get 409, and its trajectory finishes with ``abort`` (not a
        program fault). Nothing happens for an episode that is not running."""
        with self.lock:
            episode = self.running.get(name)
            if episode is None:
                return
            self.aborted.add(name)
        self.endpoint.close(episode)

    def _aborted(self, sample, prompt, record: EpisodeRecord) -> Trajectory:
        trajectory = record.row(prompt)
        trajectory.messages = record.conversation or list(sample.messages)
        trajectory.finish_reason, trajectory.reward = "abort", 0.0
        trajectory.program_log = {"error": "aborted", "stdout": "", "stderr": ""}
        return trajectory

    def _trajectory(
        self, sample, prompt, record: EpisodeRecord, result, problem: str, output: dict[str, str]
    ) -> Trajectory:
        trajectory = record.row(prompt)
        trajectory.messages = record.conversation or list(sample.messages)
        trajectory.program_log = {"error": problem, **output}
        if problem:
            self._report(problem, sample.request_id)
            trajectory.finish_reason, trajectory.reward = PROGRAM_ERROR, 0.0
        else:
            trajectory.reward, trajectory.metrics = result.reward, result.metrics
        return trajectory

    def _report(self, problem: str, episode: str) -> None:
        if problem not in self.reported and len(self.reported) < MAX_REPORTED:
            self.reported.add(problem)
            LOG.warning(
                "the agent program %s %s (episode %s; reward 0, counted in agent/program/errors; "
                "this failure is not logged again)", self.spec, problem, episode,
            )  # fmt: skip

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
