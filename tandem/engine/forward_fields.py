"""The batch fields :meth:`TorchTrainEngine.forward_backward` reads: a worker method that runs
the engine declares them in ``@register(reads=...)`` (docs/data-plane.md), with those its loss
reads.

Optional fields (positions, images, routed experts, micro-batch units) are read when the batch
has them; a :class:`~tandem.dataplane.BatchRef` lacking one is fetched without it, as a
``Batch`` would lack it. ``prompts`` is read for its width (where the responses start).
"""

from __future__ import annotations

from tandem.engine.micro_batch_plan import UNIT_FIELD
from tandem.engine.moe_routing import ROUTING_FIELD
from tandem.engine.vision_inputs import IMAGES_FIELD

FORWARD_FIELDS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "prompts",
    IMAGES_FIELD,
    ROUTING_FIELD,
    UNIT_FIELD,
)
