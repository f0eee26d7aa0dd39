"""The data protocol: :class:`Batch` and its declared fields, pure ops and byte serialisation."""

from tandem.protocol.batch import Batch, group_ids_from_uids
from tandem.protocol.fields import STANDARD_FIELDS, STANDARD_NON_TENSOR_FIELDS, FieldSpec
from tandem.protocol.serialize import from_bytes, to_buffers, to_bytes

__all__ = [
    "STANDARD_FIELDS",
    "STANDARD_NON_TENSOR_FIELDS",
    "Batch",
    "FieldSpec",
    "from_bytes",
    "group_ids_from_uids",
    "to_buffers",
    "to_bytes",
]
