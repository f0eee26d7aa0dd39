"""``RolloutReplicaWorker``: a rollout engine in a process of its own, fed weights by the checkpoint engine.

Disaggregated placement puts generation on replicas apart from the trainer; each replica is
one rank of this group, receiving every weight version from trainer rank 0 through
:mod:`tandem.checkpoint_engine` and applying it between pause and resume. In the asynchronous
pipelines (:mod:`tandem.pipeline`) a replica generates prompt groups on its engine's own
thread while its calls return at once; finished groups go into the shared-memory sample store
and only their metadata travels back (``start_groups`` / ``collect``); a replica that cannot
share files with the controller (another host) sends the tensors with it
(``write_samples_inline``). With ``dataplane.enabled`` the groups go into the replica's
data-plane store as training rows instead (``keep_samples_in_store``, which wins over
``write_samples_inline`` in either order) and a ``BatchRef`` travels back.
"""

from __future__ import annotations

import torch
from transformers.utils import logging as hf_logging

from tandem.agents.config import AgentConfig
from tandem.agents.rollout import AgentRollout
from tandem.checkpoint_engine import CheckpointEngineConfig, SenderAddress, WeightReceiver
from tandem.controller import Worker, register
from tandem.controller.profiling import ProfilesCalls
from tandem.dataplane import BatchRef, DataPlaneConfig
from tandem.device import bind_device
from tandem.engine.vision_inputs import model_image_layout
from tandem.models.loading import load_tokenizer
from tandem.models.vision import ImagePrompter
from tandem.pipeline.group_blocks import GroupBlockWriter
from tandem.pipeline.groups import GroupRequest, GroupTracker
from tandem.pipeline.requests import (
    PlaceReader,
    PromptPlaces,
    read_prompts,
    read_rows,
    rollout_requests,
    with_completions,
)
from tandem.pipeline.sample_log import SampleLog
from tandem.pipeline.sample_queue import GroupMeta
from tandem.pipeline.sample_store import InlineWriter, SampleWriter
from tandem.protocol import Batch
from tandem.protocol.generation import raise_failed_requests
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.rollout.config import RolloutEngineConfig
from tandem.rollout.factory import build_rollout_engine


class RolloutReplicaWorker(ProfilesCalls, Worker):
    """One rollout replica (see the module docstring); profiled as ``replica<rank>.json``.

    ``device``: ``auto``, ``cpu`` or ``cuda``; ``threads``: CPU threads (0: PyTorch's default);
    ``sample_dir``: the memory-backed directory of the sample store; ``agent``: the agent loops'
    settings when prompt groups run as agent episodes (``agent.*``); ``first_gpu``: the local GPU
    index of replica 0 (the GPUs before it are the trainer's; see
    :func:`tandem.pipeline.runner.replica_first_gpu`); a replica whose engine computes on several
    GPUs (vLLM's tensor parallelism) takes that many consecutive ones.
    """

    profile_name = "replica"

    def __init__(
        self,
        engine: RolloutEngineConfig,
        model_path: str,
        device: str = "auto",
        threads: int = 0,
        sample_dir: str = "/dev/shm",
        agent: AgentConfig | None = None,
        first_gpu: int = 0,
    ) -> None:
        hf_logging.disable_progress_bar()
        self.device = bind_device(device, first_gpu + self.local_rank * engine.gpus_per_engine)
        if threads and self.device.type == "cpu":
            torch.set_num_threads(threads)
        self.engine = build_rollout_engine(engine.on_device(str(self.device)), model_path)
        self.model_path = model_path
        self.receiver: WeightReceiver | None = None
        self.agents = (
            AgentRollout(agent, load_tokenizer(model_path), self.engine, ImagePrompter.for_model(model_path))
            if agent is not None
            else None
        )
        self.groups = GroupTracker(self.rank, SampleWriter(sample_dir), self.agents)
        self.prompt_reader: PlaceReader | None = None  # prompt groups sent by place (read_prompts_by_place)

    @register(dispatch="ONE_TO_ALL", blocking=False)
    def connect_weights(self, config: CheckpointEngineConfig, address: SenderAddress) -> None:
        """Join the trainer's weight sender at ``address`` as receiver ``rank + 1`` (non-blocking:
        with the broadcast backend the sender joins at the same time)."""
        self.receiver = WeightReceiver(config, address, self.rank + 1, self.device)

    @register(dispatch="ONE_TO_ALL")
    def disconnect_weights(self) -> None:
        """Leave the weight sender (a replica of the group was restarted: everyone joins a new one)."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    @register(dispatch="ONE_TO_ALL", blocking=False)
    def receive_weights(self, version: int, pause: str = "keep") -> int:
        """Apply weight ``version`` from the sender: ``pause(pause)``, load bucket by bucket, resume.

        ``keep``: requests in flight continue under the new weights (their later tokens carry
        ``version``); ``abort``: they end now. Returns the number of tensors loaded.
        """
        if self.receiver is None:
            raise RuntimeError("connect_weights() first")
        self.engine.pause(pause)
        try:
            return self.engine.update_weights(self.receiver.receive(version), version)
        finally:
            self.engine.resume()

    @register(dispatch="ONE_TO_ALL")
    def write_samples_inline(self, ranks: list[int]) -> None:
        """The replicas ``ranks`` (those the controller cannot share files with) send finished
        groups' tensors with their metadata instead of storing them in shared memory. A replica
        that keeps its groups in the data plane (:meth:`keep_samples_in_store`) goes on keeping
        them there: its blocks replace the sample store, whichever call came first."""
        if self.rank in ranks and not isinstance(self.groups.writer, GroupBlockWriter):
            self.groups.writer.discard_all()
            self.groups.writer = InlineWriter()

    @register(dispatch="ONE_TO_ALL")
    def keep_samples_in_store(
        self, ranks: list[int], config: DataPlaneConfig, prompt_width: int, response_width: int, pad_id: int
    ) -> None:
        """The replicas ``ranks`` put finished groups into their data-plane store as training rows
        (``prompt_width`` / ``response_width`` columns, ``pad_id`` padding) and report ``BatchRef`` s
        (:mod:`tandem.pipeline.group_blocks`; ``dataplane.enabled``)."""
        if self.rank in ranks:
            self.groups.writer.discard_all()
            tokenizer = load_tokenizer(self.model_path)
            images = model_image_layout(self.model_path, prompt_width)  # a VLM's rows store their images
            widths = (prompt_width, response_width)
            self.groups.writer = GroupBlockWriter(config, *widths, pad_id, tokenizer, images)

    @register(dispatch="ONE_TO_ALL")
    def read_prompts_by_place(self, ranks: list[int], places: PromptPlaces) -> None:
        """The replicas ``ranks`` read the prompt groups they are sent by place from ``places``'
        sources, tokenising and processing images with their own tokenizer and processor (the
        controller then sends no prompt's ids or images)."""
        if self.rank in ranks:
            self.prompt_reader = places.reader(load_tokenizer(self.model_path), self.model_path)

    @register(dispatch="ONE_TO_ALL")
    def log_samples(self, ranks: list[int], directory: str) -> None:
        """The replicas ``ranks`` append every group they report to their sample log in
        ``directory`` (``pipeline.record_schedule``; :mod:`tandem.pipeline.sample_log`)."""
        if self.rank in ranks:
            self.groups.sample_log = SampleLog(directory, self.rank)

    @register(dispatch="ONE_TO_ALL")
    def start_groups(self, groups: list[GroupRequest]) -> int:
        """Start generating ``groups`` on the engine's thread (a group sent by place: its prompt read
        here first); returns the groups now in flight."""
        self.groups.start(self.engine, read_prompts(groups, self.prompt_reader, self.rank))
        return self.groups.in_flight

    @register(dispatch="ONE_TO_ALL")
    def collect(
        self, wait_s: float = 0.0, room: int | None = None, at_least_one: bool = False
    ) -> tuple[list[GroupMeta], float, float]:
        """The finished groups that fit in ``room`` bytes (their tensors stored; see
        :meth:`GroupTracker.collect`), this replica's idle seconds so far and the seconds its
        finished groups waited for room; waits up to ``wait_s`` for a group to finish."""
        groups = self.groups.collect(wait_s, room, at_least_one)
        return groups, self.groups.idle_seconds(), self.groups.waited_seconds()

    @register(dispatch="ONE_TO_ALL")
    def abort_all(self) -> int:
        """Abort every group in flight (shutdown); returns how many."""
        return self.groups.abort_all(self.engine)

    @register(dispatch="ONE_TO_ALL")
    def generate(self, requests: list[RolloutRequest]) -> list:
        """Completions of ``requests``, in order (validation), alongside any groups in flight."""
        futures = [self.engine.submit(r) for r in requests]
        return [f.result() for f in futures]

    @register(dispatch="ONE_TO_ALL")
    def generate_to_store(self, prompts: Batch, sampling: SamplingParams) -> BatchRef:
        """Each row's completion (its ``prompt_ids``, or those of the row its place names, under its
        own ``seed``), alongside any groups in flight, kept in this replica's data-plane store as
        training rows at the run's widths: back only a ``BatchRef`` with the rows' scalars and
        decoded texts (ReMax's greedy baselines and validation with ``dataplane.enabled``;
        :meth:`keep_samples_in_store` first). With agent loops each row is an episode, scored on
        its conversation (no decoded text)."""
        writer = self.groups.writer
        if not isinstance(writer, GroupBlockWriter):
            raise RuntimeError("keep_samples_in_store() first: this replica keeps no rows in the data plane")
        prompts = read_rows(prompts, self.prompt_reader, self.rank)  # rows named by place: read here
        if self.agents is not None:
            episodes = self.agents.generate(prompts, sampling, writer.prompt_width, self.rank)
            return writer.put_rows(episodes, decode=False)
        requests = rollout_requests(prompts, prompts["seed"], sampling, f"stored-{self.rank}")
        completions = [f.result() for f in [self.engine.submit(r) for r in requests]]
        raise_failed_requests(completions, f"generation on rollout replica {self.rank}")
        widths = (writer.prompt_width, writer.response_width)
        return writer.put_rows(with_completions(prompts, completions, writer.pad_id, widths))

    @register(dispatch="DP_COMPUTE")
    def generate_episodes(self, prompts: Batch, sampling: SamplingParams, prompt_width: int) -> Batch:
        """Each row's agent episode (``raw_prompt``, ``seed``) as sequence tensors (validation),
        alongside any groups in flight."""
        if self.agents is None:
            raise RuntimeError("this replica was built without agent.* settings")
        return self.agents.generate(prompts, sampling, prompt_width, self.rank)

    @register(dispatch="ONE_TO_ALL")
    def agent_tool_totals(self) -> dict[str, tuple[int, int, float]]:
        """The tools' ``(calls, errors, seconds)`` since the last call (empty without agents)."""
        return self.agents.tool_totals() if self.agents is not None else {}

    @register(dispatch="ONE_TO_ALL")
    def generate_greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of ``prompts`` (token ids), for checks of what the weights say."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        requests = [RolloutRequest(f"greedy-{i}", tuple(p), params) for i, p in enumerate(prompts)]
        return [list(c.token_ids) for c in self.engine.generate_batch(requests)]

    @register(dispatch="ONE_TO_ALL")
    def weight_version(self) -> int:
        return self.engine.version

    @register(dispatch="ONE_TO_ALL")
    def model_weights(self) -> dict[str, torch.Tensor]:
        """Copies of the engine's weights by name, on the CPU (native and hf engines)."""
        return {name: p.detach().cpu().clone() for name, p in self.engine.model.state_dict().items()}

    @register(dispatch="ONE_TO_ALL")
    def close_engine(self) -> None:
        """Close the weight receiver and the engine, and delete this replica's stored samples."""
        if self.receiver is not None:
            self.receiver.close()
        if self.agents is not None:
            self.agents.close()
        self.engine.close()
        self.groups.writer.discard_all()
