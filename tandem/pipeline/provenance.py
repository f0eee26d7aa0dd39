"""Where each asynchronous training row came from: per-row columns made from its group's metadata.

A rollout replica reports, with each finished group (:class:`~tandem.pipeline.sample_queue.GroupMeta`),
the seeds and request ids of its responses; the replica's driver stamps the replica's restart
generation on it. :func:`provenance_columns` turns a draw's groups into per-row columns, which
:func:`~tandem.pipeline.runner.assemble_batch` and :func:`~tandem.pipeline.runner.assemble_stored`
add to the batch (inline Python columns: the controller has them already, no token moves):

* ``replica``: the index of the replica that generated the row;
* ``replica_generation``: how many times that replica had been restarted when it reported the row
  (0: the first process; ``pipeline.replica_restarts``);
* ``seed``: the sampling seed of the row's request (the sync pipeline's rows carry the same
  column). Resampled from the same prompt with this seed on the same weights, the response is the
  same tokens (``tests/pipeline/test_provenance.py``);
* ``request_id``: the engine's id of the request, ``<group uid>/<response>``.

Each token's weight version is the stored ``weight_version`` field; a row's oldest and newest are
``oldest_version`` / ``newest_version`` (inline with ``dataplane.enabled``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.pipeline.sample_queue import GroupMeta

REPLICA = "replica"
REPLICA_GENERATION = "replica_generation"
SEED = "seed"
REQUEST_ID = "request_id"
PROVENANCE = (REPLICA, REPLICA_GENERATION, SEED, REQUEST_ID)


def request_id(uid: str, response: int) -> str:
    """The engine's request id of response ``response`` of prompt group ``uid``."""
    return f"{uid}/{response}"


def provenance_columns(groups: list[GroupMeta]) -> dict[str, list]:
    """The columns above for the rows of ``groups``, each group's responses in order (the row
    order of the assembled batch); every list has one entry per row."""
    columns: dict[str, list] = {name: [] for name in PROVENANCE}
    for group in groups:
        rows = len(group.finish_reasons)
        if len(group.seeds) != rows or len(group.request_ids) != rows:
            raise ValueError(
                f"prompt group {group.uid!r} reports {len(group.seeds)} seed(s) and "
                f"{len(group.request_ids)} request id(s) for {rows} responses"
            )
        columns[REPLICA] += [group.replica] * rows
        columns[REPLICA_GENERATION] += [group.generation] * rows
        columns[SEED] += list(group.seeds)
        columns[REQUEST_ID] += list(group.request_ids)
    return columns
