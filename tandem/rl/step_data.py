"""Where one policy-gradient step's per-token data lives while its stages run: in the controller's
``Batch`` (today's path) or in the data plane's stores (``dataplane.enabled``; docs/data-plane.md).

``RLTrainer._policy_gradient_update`` runs the stages once, in one order, over either holder:

* ``stage(group, method)``: a stage (old log-probs, reference, teacher, critic values) runs on
  the step's rows and its outputs join the step (``joined=True``: on the outputs so far too);
* then the advantages, on the ranks (:mod:`tandem.rl.ref_advantages`, with a ``RefStep``:
  ``joined()`` the step's references, ``keep(group, output)`` each part's outputs,
  ``for_updates_with(outputs)`` what the updates get) or on the controller: ``view(reads)`` the
  controller's ``Batch`` holding at least ``reads`` of the stages' outputs, and
  ``for_updates(view)`` what the updates (critic, actor) get once the advantages are in ``view``;
* ``release()``: the step's stored blocks are freed (however the step ends).

:class:`BatchStep` holds everything in one ``Batch``, unioned stage by stage. :class:`RefStep`
puts the step's padded batch into the store once (``BatchRef.put``: the per-token fields as one
block, the per-row scalars inline); each stage gets that ``BatchRef``, its ranks fetch only the
fields the method declares (``@register(reads=...)``) of only their rows and keep their outputs
in their own store (``outputs="ref"``). So do the advantages' two parts, run by the actor's ranks;
the controller holds, of the step, only its per-row scalars (uid, scores, lengths, and what the
parts send back inline: ``[B]`` sequence rewards, valid-token counts, partial sums) and the
references. The updates get a ``BatchRef`` joining the first block, the stage outputs and the
advantages' outputs. A fixed-seed run's metrics are the same either way, but for a few means over
tokens reduced from per-row partial sums (tests/rl/test_dataplane_step.py,
tests/rl/test_dataplane_advantages.py).

When the draw itself came back as a ``BatchRef`` (the rollout ranks kept their outputs,
:mod:`tandem.pipeline.stored_rollout`), :class:`RefStep` puts nothing at the start: that reference
is the first block, released by the group that generated it; no token id reaches the controller,
nor any other per-token field.

Where the advantages stay on the controller (an estimator that reads other rows' tokens, an
overridden ``compute_advantages``, a plan with ``view`` stages), ``view`` fetches the stage outputs
the advantages read and, for a stored draw, the rollout fields they read (``response_mask``, and
``rollout_log_probs`` when old or teacher log-probs are in:
:func:`tandem.rl.advantages.rollout_reads`), and spreads ``token_level_scores`` from the per-row
score; ``for_updates`` puts the fields that computation made or changed back as one block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.controller import RoleView, WorkerGroup
from tandem.dataplane import BatchRef, DataPlaneConfig, store_for
from tandem.dataplane import get as get_block
from tandem.dataplane import release as release_block
from tandem.pipeline.stored_rollout import LAST_SAMPLED
from tandem.protocol import Batch
from tandem.rl.advantages import rollout_reads
from tandem.rl.scoring import SEQUENCE_SCORE, token_level_scores

Group = WorkerGroup | RoleView
Stage = Callable[[Any], Any]  # a group's bound method: a Batch or BatchRef in, the same kind out


def use_data_stores(groups: list[Group | None], config: DataPlaneConfig) -> None:
    """Every rank of ``groups`` (worker groups or colocated role views) keeps its outputs in
    ``config``'s store."""
    for group in {id(g): g for g in map(worker_group, groups) if g is not None}.values():
        group.use_data_store(config)


def worker_group(group: Group | None) -> WorkerGroup | None:
    """The worker group behind ``group`` (a colocated role view's group, or the group itself)."""
    return group.group if isinstance(group, RoleView) else group


def step_data(
    batch: Batch | BatchRef,
    config: DataPlaneConfig,
    enabled: bool,
    producer: Group | None = None,
    streamed: dict[str, tuple[Group, BatchRef]] | None = None,
) -> BatchStep | RefStep:
    """The holder of the step's data: the store's when ``enabled`` or when ``batch`` is already a
    ``BatchRef`` (put by ``producer``'s ranks, who release it), else the ``Batch`` itself.
    ``streamed``: passes' outputs for the stored draw's rows made before the step, by method name
    (``pipeline.stream_forward``: :mod:`tandem.rl.stream_forward`), which the step keeps instead of
    running those methods."""
    if isinstance(batch, BatchRef):
        if producer is None:
            raise ValueError("a stored draw needs the group that put it (producer), to release it")
        return RefStep(batch, config, producer, streamed)
    return RefStep(batch, config) if enabled else BatchStep(batch)


def rollout_stays_in_store(config: Any, has_images: bool, plan: Any) -> bool:
    """Whether a run's draws stay where they were generated (``dataplane.enabled``; ``config`` is
    the trainer's, ``has_images``: whether its training prompts hold images, ``plan`` its
    :class:`tandem.rl.step_plan.StepPlan`): on the trainer's workers in ``sync``, in the rollout
    replicas' blocks in the asynchronous modes (:mod:`tandem.pipeline.group_blocks`).

    Not for a plan with a stage that still rebuilds or extends the draw's padded batch on the
    controller (``StepPlan.takes_stored_draws``: each stage declares it; a plugin's ``view``
    stage). Image prompts stay stored (``has_images``: their images are tensor columns of the
    workers' and the replicas' blocks, :mod:`tandem.dataplane.images`); agent
    episodes stay stored (the asynchronous replicas': :meth:`tandem.pipeline.group_blocks.GroupBlockWriter.rows`;
    an agent program's in ``sync`` at a prompt width fixed before the draw:
    :func:`tandem.rl.batch_source.stored_prompt_width`). Those runs put the controller's batch
    once. ``pipeline.old_log_probs=rollout`` gives the stored log-probs a second name
    (``BatchRef.alias``), and ``pipeline.sample_store`` says how the samples travel only where the
    draws are not stored (the replicas' blocks replace the sample store: :mod:`tandem.pipeline.replica_set`)."""
    return config.dataplane.enabled and plan.takes_stored_draws


class BatchStep:
    """Today's path: the stages take and extend one ``Batch`` that the controller holds."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch

    def stage(self, group: Group, method: Stage, joined: bool = False) -> None:
        self.batch = self.batch.union(method(self.batch))

    def view(self, reads: tuple[str, ...]) -> Batch:
        return self.batch

    def for_updates(self, view: Batch) -> Batch:
        return view

    def release(self) -> None:
        pass


class RefStep:
    """The stages on references: the controller puts the step's batch once (unless the draw is
    already stored) and fetches no per-token field when the advantages run on the ranks (see the
    module docstring)."""

    def __init__(
        self,
        batch: Batch | BatchRef,
        config: DataPlaneConfig,
        producer: Group | None = None,
        streamed: dict[str, tuple[Group, BatchRef]] | None = None,
    ) -> None:
        self.store = store_for(config)
        self.kept: list[BatchRef] = []  # the stages' outputs, kept on their ranks, in stage order
        self._releases: list[Callable[[], None]] = []
        self.streamed = {name: output for name, (_, output) in (streamed or {}).items()}
        for group, output in (streamed or {}).values():  # the step's, whether a stage takes it or not
            self._releases.append(lambda group=group, output=output: worker_group(group).release_refs(output))
        self.fetched: dict[str, Any] = {}  # the first block's fields the controller read (view)
        if isinstance(batch, BatchRef):  # the draw, kept by the ranks that generated it
            self.batch = batch.scalars
            self.first = batch
            self._releases.append(lambda: worker_group(producer).release_refs(batch))
        else:
            self.batch = batch
            self.first = self._put(batch)

    def _put(self, batch: Batch) -> BatchRef:
        ref = BatchRef.put(batch, self.store)
        self._releases.append(lambda: ref.release(release_block))
        return ref

    def stage(self, group: Group, method: Stage, joined: bool = False) -> None:
        """``method`` over the step's first block (its draw), or with ``joined`` over it and the
        outputs kept so far (a stage that reads an earlier stage's: GKD's dataset steps). A method
        whose output was streamed is not run again: that output joins the step."""
        if method.__name__ in self.streamed:
            self.kept.append(self.streamed.pop(method.__name__))
            return
        output = method(self.joined() if joined else self.first)
        self.kept.append(output)
        self._releases.append(lambda: worker_group(group).release_refs(output))

    def view(self, reads: tuple[str, ...]) -> Batch:
        """The step's batch with ``reads`` of the kept outputs that hold them (padded tensors); for
        a stored draw, also the rollout fields the advantages read and the per-token scores."""
        tensors: dict[str, Any] = {}
        stored = SEQUENCE_SCORE in self.batch
        made = {f for output in [self.first, *self.kept] for f in output.schema}  # the first's alias too
        from_rollout = rollout_reads(made) if stored else ()
        in_first = [f for f in dict.fromkeys([*from_rollout, *reads]) if f in self.first.schema]
        from_first = in_first if stored else []  # (old_log_probs=rollout: an alias in the draw)
        for output in self.kept:  # (a stage made a dataset step's rollout log-probs: GKD)
            wanted = [f for f in {*reads, *from_rollout} - set(from_first) if f in output.schema]
            if wanted:
                tensors.update(output.materialise(get_block, sorted(wanted)).tensors.items())
        if stored:
            self.fetched = dict(self.first.materialise(get_block, from_first).tensors.items())
            scores = token_level_scores(
                self.batch[SEQUENCE_SCORE], self.batch[LAST_SAMPLED], self.first.schema["responses"].shape[0]
            )
            tensors.update({**self.fetched, "token_level_scores": scores})
        return self.batch.assign(tensors=tensors)

    def for_updates(self, view: Batch) -> BatchRef:
        """The first block joined with the fields ``view`` made or changed (put as one block) and
        the kept outputs."""
        kept = {f for output in self.kept for f in output.schema}
        batch, fetched = self.batch, self.fetched
        changed = [
            k
            for k, t in view.tensors.items()
            if k not in kept
            and k != "token_level_scores"  # the updates read the rewards made from it, not it
            and (k not in batch or batch[k] is not t)
            and fetched.get(k) is not t
        ]
        step = self.first.select([k for k in self.first.keys() if k not in changed])
        if changed:
            step = step.union(self._put(view.select(changed)))
        for output in self.kept:
            step = step.union(output)
        return step

    def joined(self) -> BatchRef:
        """The step's rows as references: the first block joined with the kept stage outputs."""
        step = self.first
        for output in self.kept:
            step = step.union(output)
        return step

    def keep(self, group: Group, output: BatchRef) -> BatchRef:
        """``output`` (kept on ``group``'s ranks) is the step's: released with it."""
        self._releases.append(lambda: worker_group(group).release_refs(output))
        return output

    def for_updates_with(self, outputs: list[BatchRef]) -> BatchRef:
        """What the updates get when the advantages ran on the ranks: the first block and the kept
        stage outputs joined with ``outputs`` (the advantages' stored fields), whose fields win
        over the first block's (the corrected ``response_mask``)."""
        made = {f for output in outputs for f in output.stored_fields()}
        step = self.first.select([k for k in self.first.keys() if k not in made])
        for output in [*self.kept, *outputs]:
            step = step.union(output)
        return step

    def release(self) -> None:
        for release in reversed(self._releases):
            release()
        self._releases.clear()
