"""``AgentRollout``: a worker's generation when agent loops run (``agent.*``): episodes in, the
data protocol's sequence tensors out.

Each row of a prompt batch becomes an :class:`~tandem.agents.loops.AgentSample` (its
``raw_prompt`` messages, seed, ``extra_info`` and ``agent_name`` when the data has that
column); the episodes run at once over the worker's rollout engine; each trajectory becomes a
completion whose ``token_mask`` keeps the model's tokens apart from the tool and user turns
(``response_mask`` 0 there). The rows gain ``agent_messages`` (the conversation),
``agent_turns``, ``agent_tool_calls``, ``agent_tool_errors``, ``agent_reward`` (an interaction's
or an agent program's reward, None where none ended the episode) and ``finish_reason``; with
``agent.program``, also ``agent_program_splits`` (each episode's new segments),
``agent_program_metrics`` (what the program returned as metrics) and ``agent_program_log``
(``{"error", "stdout", "stderr"}``: why it failed, empty when it did not, and a command's output
as kept). An agent program's row may
have a longer prompt than the dataset's (a system prompt the program adds): a training draw's
``prompt_width`` leaves room for it (:func:`tandem.rl.batch_source.stored_prompt_width`, in every
mode), so the row's prompt stays in its prompt columns; where ``prompt_width`` is narrower
(validation, greedy baselines: the batch's widest prompt) its extra tokens move into the response
columns, masked 0 (:func:`~tandem.agents.program.recorder.fit_prompt_columns`). A split episode's row holds its
segments end to end: its ``position_ids`` restart at 0 where each later segment starts, so the
trainer computes each token from its own segment (packed: :func:`tandem.engine.packing.pack_sequences`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from tandem.agents.config import AgentConfig
from tandem.agents.generators import EngineGenerator
from tandem.agents.loops import (
    AgentContext,
    AgentSample,
    EpisodeThread,
    load_interaction,
    run_episodes,
    turn_request_id,
)
from tandem.agents.program.recorder import fit_prompt_columns
from tandem.agents.sandbox import sandbox_available
from tandem.agents.segments import with_segment_positions
from tandem.agents.tool_calls import TOOL_CALL_PARSERS
from tandem.agents.tools import CALCULATOR, Tool, ToolRunner, load_user_tools, python_tool
from tandem.models.vision import ImagePrompter
from tandem.protocol import Batch
from tandem.protocol.generation import Completion, SamplingParams
from tandem.protocol.sequences import resize_columns, sequence_tensors
from tandem.rollout.base import RolloutEngine


def build_tools(config: AgentConfig) -> list[Tool]:
    """The built-in tools named in ``agent.tools`` and the user tools of ``agent.tools_path``."""
    tools: list[Tool] = []
    for name in config.tools:
        if name == "calculator":
            tools.append(CALCULATOR)
        elif name == "python":
            reason = sandbox_available()
            if reason:
                raise RuntimeError(f"agent.tools has 'python', but no sandbox can run here: {reason}")
            tools.append(python_tool(config.python))
    if config.tools_path:
        tools += load_user_tools(config.tools_path)
    return tools


class AgentRollout:
    """Episodes on one worker's engine (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        tokenizer: Any,
        engine: RolloutEngine,
        prompter: ImagePrompter | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.engine = engine
        self.prompter = prompter  # a vision-language model's: episodes' prompts then take images
        self.generator = EngineGenerator(engine)
        self._contexts: dict[SamplingParams, AgentContext] = {}
        self._episodes: EpisodeThread | None = None  # started by the first submit_episode
        tools = build_tools(config)
        self.tools = ToolRunner(tools, config.tool_concurrency, config.tool_timeout_s) if tools else None
        self.parser = TOOL_CALL_PARSERS.get(config.tool_parser)
        self.interaction = (
            load_interaction(config.interaction_path, config.interaction_name)
            if config.interaction_path
            else None
        )
        self.program = None
        if config.uses_program:
            # deferred: the endpoint needs the serve extra (FastAPI, uvicorn, openai)
            from tandem.agents.program.runner import ProgramRunner

            self.program = ProgramRunner(
                config.program, config.program_limits, engine, tokenizer, self.parser, config.program_command
            )

    def generate(self, prompts: Batch, sampling: SamplingParams, prompt_width: int, rank: int) -> Batch:
        """The rows of ``prompts`` (with ``raw_prompt`` and ``seed``) completed by their episodes,
        as sequence tensors padded to ``prompt_width`` and ``sampling.max_tokens``."""
        names = prompts["agent_name"] if "agent_name" in prompts else [""] * len(prompts)
        images = prompts["images"] if "images" in prompts else [None] * len(prompts)
        samples = [
            AgentSample(list(messages), int(seed), f"{rank}-{i}", dict(info or {}), str(name or ""), pictures)
            for i, (messages, seed, info, name, pictures) in enumerate(
                zip(prompts["raw_prompt"], prompts["seed"], prompts["extra_info"], names, images, strict=True)
            )
        ]
        trajectories = run_episodes(self.context(sampling), samples)
        if self.program is not None:
            trajectories = [fit_prompt_columns(t, prompt_width) for t in trajectories]
        longest = max(len(t.prompt_ids) for t in trajectories)
        if longest > prompt_width:
            raise ValueError(
                f"an agent prompt (with the tools' schemas) has {longest} tokens, more than the batch's "
                f"{prompt_width}: raise data.max_prompt_length or offer fewer tools"
            )
        completions = [
            Completion(
                sample.request_id, t.prompt_ids, t.token_ids, t.log_probs, t.weight_versions,
                t.finish_reason, token_mask=t.loss_mask,
            )
            for sample, t in zip(samples, trajectories, strict=True)
        ]  # fmt: skip
        pad = self.tokenizer.pad_token_id
        tensors = sequence_tensors([t.prompt_ids for t in trajectories], completions, pad)
        tensors = resize_columns(tensors, prompt_width, sampling.max_tokens, pad)
        tensors = with_segment_positions(tensors, [t.segment_starts for t in trajectories])  # split episodes
        return prompts.assign(
            tensors=tensors,
            non_tensors={
                "finish_reason": [t.finish_reason for t in trajectories],
                "agent_messages": [t.messages for t in trajectories],
                "agent_turns": [t.turns for t in trajectories],
                "agent_tool_calls": [t.tool_calls for t in trajectories],
                "agent_tool_errors": [t.tool_errors for t in trajectories],
                "agent_reward": [t.reward for t in trajectories],
                **(
                    {
                        "agent_program_splits": [t.splits for t in trajectories],
                        "agent_program_metrics": [t.metrics for t in trajectories],
                        "agent_program_log": [t.program_log for t in trajectories],
                    }
                    if self.program is not None
                    else {}
                ),
            },
        )

    def context(self, sampling: SamplingParams) -> AgentContext:
        """The loops' context for ``sampling`` (one per distinct setting, kept)."""
        if sampling not in self._contexts:
            self._contexts[sampling] = AgentContext(
                self.generator, self.tokenizer, sampling, self.config.name, self.config.max_turns,
                self.tools, self.parser, self.interaction,
                interaction_timeout_s=self.config.interaction_timeout_s,
                max_message_chars=self.config.max_message_chars, prompter=self.prompter,
                program=self.program,
            )  # fmt: skip
        return self._contexts[sampling]

    def submit_episode(self, sample: AgentSample, sampling: SamplingParams) -> Future:
        """Start ``sample``'s episode on a background loop (while other episodes and calls go on);
        a ``concurrent.futures.Future`` of its :class:`~tandem.agents.trajectory.Trajectory`."""
        if self._episodes is None:
            self._episodes = EpisodeThread()
        return self._episodes.submit(self.context(sampling), sample)

    def abort_episode(self, episode_id: str) -> None:
        """End the model turn the episode ``episode_id`` is waiting for (or will start), or its agent
        program's episode: the episode then finishes with ``abort``."""
        if self.program is not None:
            self.program.abort(episode_id)
            return
        for turn in range(self.config.max_turns + 1):
            self.engine.abort(turn_request_id(episode_id, turn))

    def close(self) -> None:
        if self._episodes is not None:
            self._episodes.close()
        if self.program is not None:
            self.program.close()

    def tool_totals(self) -> dict[str, tuple[int, int, float]]:
        """The tools' ``(calls, errors, seconds)`` since the last call, then reset."""
        if self.tools is None:
            return {}
        totals = self.tools.stats.totals()
        self.tools.stats = type(self.tools.stats)()
        return totals
