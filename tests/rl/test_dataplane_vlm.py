"""``dataplane.enabled`` on image prompts (``pipeline.mode=sync``): the draw stays on the workers
that generated it, its images stored as tensor columns (:mod:`tandem.dataplane.images`), and the
ranks that read ``images`` (the reference's forward, the update) rebuild each row's
``ImageInputs`` from them. A fixed-seed run's metrics equal, step for step, those of the ``Batch``
path (which sends the images' Python objects to every stage); the controller fetches no stored
byte, serialises no batch payload in the step and holds no image."""

from collections import Counter

import pytest

from tandem.dataplane import traffic
from tandem.dataplane.images import IMAGE_GRIDS, IMAGE_PIXELS
from tandem.protocol.images import IMAGES_FIELD
from tandem.rl.step_data import RefStep
from tests.pipeline.test_async_dataplane import TWO_CORES, ReplicaRecordingTrainer
from tests.rl.conftest import assert_same_histories
from tests.rl.test_dataplane_step import CountingTrainer, assert_draws_stay_stored, assert_equal_metrics
from tests.rl.test_vlm_grpo import vlm_config, vlm_files  # noqa: F401 (the tiny VLM and its shapes data)


@pytest.mark.slow  # two 2-step runs of the tiny VLM: ~25 s of CPU (about a minute on 2 busy cores)
def test_in_process_vlm_grpo_with_the_draw_stored_matches_the_batch_path(vlm_files, tmp_path, monkeypatch):  # noqa: F811
    """One in-process worker, two GRPO steps (the reference's log-probs for the KL loss)."""
    in_stages: list[int] = []  # store bytes each stage's call fetched (its ranks run in this process)
    stage = RefStep.stage

    def counted_stage(self, *args, **kwargs):
        before = traffic().fetched_bytes
        stage(self, *args, **kwargs)
        in_stages.append(traffic().fetched_bytes - before)

    monkeypatch.setattr(RefStep, "stage", counted_stage)
    overrides = ("data.val_path=", "data.train_batch_size=2")
    off = CountingTrainer(vlm_config(vlm_files, tmp_path / "off", *overrides, "dataplane.enabled=false"))
    off_history = off.fit().history
    counters = traffic()
    on = CountingTrainer(vlm_config(vlm_files, tmp_path / "on", *overrides, "dataplane.enabled=true"))
    on_history = on.fit().history
    used = traffic() - counters
    assert_equal_metrics(off_history, on_history)
    assert all(IMAGES_FIELD in draw and any(draw[IMAGES_FIELD]) for draw in off.draws)  # images on both
    assert_draws_stay_stored(on)
    for draw, view in zip(on.draws, on.views, strict=True):
        assert {IMAGE_PIXELS, IMAGE_GRIDS} <= set(draw.stored_fields())
        assert IMAGES_FIELD not in draw.scalars and IMAGES_FIELD not in view
    # the ranks read the images from the store: the reference stage and the update each fetched them
    assert len(in_stages) == 2 and all(in_stages)
    # each prompt's pixels once, however many of its responses the update trains on (the Batch
    # path's pickle, too, carries a group's one ImageInputs object once)
    for update, draw in zip(on.update_by_field, off.draws, strict=True):
        distinct = {id(image): image for image in draw[IMAGES_FIELD] if image is not None}.values()
        assert 0 < Counter(update)[IMAGE_PIXELS] <= sum(image.pixel_values.nbytes for image in distinct)
    # the controller itself, outside the stages' and the updates' calls, fetched nothing
    assert [own - stage for own, stage in zip(on.own_fetched, in_stages, strict=True)] == [0, 0]
    assert on.step_bytes == [0, 0]  # no batch payload serialised by the controller in the step
    assert used.blocks_released == used.blocks_put > 0
    assert on.left == [[], []]


@pytest.mark.slow  # two 2-step one-step-off runs of the tiny VLM, with a replica process each
def test_one_step_off_vlm_grpo_keeps_the_images_in_the_replicas_blocks(vlm_files, tmp_path):  # noqa: F811
    """The replica's blocks hold each group's images as tensor columns (the tracker packs the
    request's images, :mod:`tandem.pipeline.group_blocks`); the trainer's ranks read them there.
    Metrics equal today's path (sample files the controller maps, images inline) step for step."""
    overrides = ("data.val_path=", "data.train_batch_size=2", "pipeline.mode=one_step_off", *TWO_CORES)
    today = ReplicaRecordingTrainer(vlm_config(vlm_files, tmp_path / "off", *overrides, "dataplane.enabled=false"))
    today_history = today.fit().history
    refs = ReplicaRecordingTrainer(
        vlm_config(vlm_files, tmp_path / "on", *overrides, "dataplane.enabled=true")
    )
    stored_history = refs.fit().history

    def comparable(history):  # a block's bytes are not a sample file's: the byte metrics differ
        return [{k: v for k, v in h.items() if not k.startswith("pipeline/inflight")} for h in history]

    assert_same_histories(comparable(today_history), comparable(stored_history))
    assert_draws_stay_stored(refs)
    for draw in refs.draws:
        assert {IMAGE_PIXELS, IMAGE_GRIDS} <= set(draw.stored_fields()) and IMAGES_FIELD not in draw.scalars
    assert refs.step_bytes == [0, 0]
    assert refs.left == [[], []]
