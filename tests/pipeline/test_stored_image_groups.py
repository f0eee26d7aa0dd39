"""Asynchronous image-prompt groups kept in the data plane: a replica's block of a vision-language
group holds its rows' images as tensor columns (:mod:`tandem.dataplane.images`), and the rows
assembled by reference and fetched as a rank that reads ``images`` fetches them equal the
controller's ``assemble_batch`` of the same groups bit for bit, images included (its
``ImageInputs`` processed again from the prompts' files); none of the images stays inline."""

import dataclasses
import time

import pytest
import torch

from tandem.data import write_parquet
from tandem.dataplane import DataPlaneConfig, get
from tandem.dataplane.images import IMAGE_GRIDS, IMAGE_PIXELS, materialise_with_images
from tandem.engine.vision_inputs import model_image_layout
from tandem.models import load_tokenizer
from tandem.models.tiny_vlm import save_tiny_vlm
from tandem.pipeline.group_blocks import PROMPT_FIELD, GroupBlockWriter
from tandem.pipeline.groups import GroupRequest, GroupTracker
from tandem.pipeline.runner import assemble_batch, assemble_stored
from tandem.pipeline.sample_store import SampleWriter, read_fields, release, stored_nbytes
from tandem.protocol.images import IMAGES_FIELD
from tandem.rl.config import RLDataConfig
from tandem.rl.data import RLDataset, image_reader
from tandem.rl.data.shapes import shapes_rows
from tandem.rollout import SamplingParams
from tandem.rollout.native import NativeEngineConfig, NativeRolloutEngine
from tests.dataplane.test_stored_images import assert_same_images

N = 2
PARAMS = SamplingParams(temperature=1.0, max_tokens=4)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_groups")
    model = str(save_tiny_vlm(root / "model"))
    rows = shapes_rows(4, seed=0)
    rows[3] = {**rows[3], "images": None, "prompt": [{"role": "user", "content": "Name a colour."}]}
    train = write_parquet(rows, root / "train.parquet")
    tokenizer = load_tokenizer(model)
    reader = image_reader(model, RLDataConfig(train_path=str(train)))
    return model, tokenizer, RLDataset.load(train, tokenizer, 256, images=reader)


def test_stored_image_groups_assemble_to_the_controllers_batch_bit_for_bit(vlm, tmp_path):
    """Groups with an image and one without, generated once (sample files, today's path) and
    written again as the replica's blocks from the same tensors the tracker packs (the request's
    images beside its prompt): ``assemble_stored`` fetched with ``images`` equals
    ``assemble_batch`` field for field; each block's size is what the writer predicted."""
    model, tokenizer, dataset = vlm
    (tmp_path / "samples").mkdir()
    (tmp_path / "blocks").mkdir()
    order = [2, 3, 0]  # an image group, the text group, another image group
    images = {i: dataset.collate([i])[IMAGES_FIELD][0] for i in order}
    assert images[3] is None and images[0] is not None
    groups = [
        GroupRequest(
            f"g{g}", i, tuple(dataset.samples[i].prompt_ids), (10 * g, 10 * g + 1), PARAMS, None, images[i]
        )
        for g, i in enumerate(order)
    ]
    engine = NativeRolloutEngine.from_pretrained(model, NativeEngineConfig(max_model_len=256))
    tracker = GroupTracker(replica=0, writer=SampleWriter(str(tmp_path / "samples")))
    tracker.start(engine, groups)
    while tracker.in_flight:
        time.sleep(0.01)
    engine.close()
    metas = {m.uid: m for m in tracker.collect(0.0)}
    in_order = [metas[g.uid] for g in groups]

    width = max(len(s.prompt_ids) for s in dataset.samples)
    layout = model_image_layout(model, width)
    config = DataPlaneConfig(directory=str(tmp_path / "blocks"))
    writer = GroupBlockWriter(config, width, PARAMS.max_tokens, tokenizer.pad_token_id, tokenizer, layout)
    stored = []
    for group, meta in zip(groups, in_order, strict=True):
        fields = {**read_fields(meta.ref), PROMPT_FIELD: torch.tensor(group.prompt_ids)}
        if group.images is not None:  # as GroupTracker._pack packs them for this writer
            fields.update({IMAGE_PIXELS: group.images.pixel_values, IMAGE_GRIDS: group.images.image_grid_thw})
        ref = writer.write(meta.uid, fields)
        assert stored_nbytes(ref) == writer.size_of(fields)  # the byte bound counts the images too
        stored.append(dataclasses.replace(meta, ref=ref))

    assembled = assemble_stored(stored, dataset, N)
    assert {IMAGE_PIXELS, IMAGE_GRIDS} <= set(assembled.stored_fields())
    assert IMAGES_FIELD not in assembled.scalars  # no Python image object inline
    got = materialise_with_images(assembled, get)
    expected = assemble_batch(in_order, dataset, N, tokenizer.pad_token_id)  # releases the sample files
    for name, value in expected.tensors.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    assert any(expected[IMAGES_FIELD]) and not all(expected[IMAGES_FIELD])
    assert_same_images(list(got[IMAGES_FIELD]), list(expected[IMAGES_FIELD]))
    for meta in stored:
        release(meta.ref)
    assert not list((tmp_path / "blocks").iterdir()) and not list((tmp_path / "samples").iterdir())
