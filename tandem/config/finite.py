"""One pass over every float field of a typed config, refusing NaN and ``inf`` by the key's full
path before anything loads (``actor.engine.lr=nan``), so no float field depends on its own
``__post_init__`` remembering to check.

A field whose documentation says ``inf`` means "no limit" declares it on the field:
``is_threshold: float = no_limit_at_inf(2.0)``; NaN is refused there too.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from tandem.config.keys import unwrap_optional
from tandem.config.validation import check_finite

INF_MEANS_NO_LIMIT = "inf_means_no_limit"  # the field metadata key :func:`no_limit_at_inf` sets


def no_limit_at_inf(default: float) -> Any:
    """A dataclass field with ``default`` that may also be ``inf``, meaning "no limit"."""
    return dataclasses.field(default=default, metadata={INF_MEANS_NO_LIMIT: True})


def check_finite_floats(schema: type, values: Any, prefix: str = "") -> None:
    """Raise ``ValueError`` naming ``prefix + field`` for the first float of ``values`` that is NaN,
    or ``inf``/``-inf`` where its field does not mean "no limit" by it.

    Args:
        schema: a dataclass; its fields typed ``float``, ``float | None``, ``tuple[float, ...]``
            or ``list[float]`` are checked, nested dataclass fields recursively, free-form
            mappings not at all.
        values: an instance of ``schema``, or the OmegaConf node a loader builds it from (read
            by attribute, so before ``OmegaConf.to_object`` runs any ``__post_init__``).
        prefix: the dotted path of ``values`` as the user writes it (``actor.`` …), ``""`` at the root.
    """
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        kind = unwrap_optional(hints[field.name])
        value = getattr(values, field.name)
        key = prefix + field.name
        if value is None:
            continue
        if dataclasses.is_dataclass(kind):
            check_finite_floats(kind, value, key + ".")
        elif _holds_floats(kind):
            allow_inf = bool(field.metadata.get(INF_MEANS_NO_LIMIT))
            sequence = _is_sequence(kind)
            for index, item in enumerate(list(value) if sequence else [value]):
                check_finite("", f"{key}[{index}]" if sequence else key, item, allow_inf=allow_inf)


def _is_sequence(kind: Any) -> bool:
    return typing.get_origin(kind) in (tuple, list)


def _holds_floats(kind: Any) -> bool:
    """``float``, or a tuple/list whose items are all typed ``float``."""
    if kind is float:
        return True
    if not _is_sequence(kind):
        return False
    items = [a for a in typing.get_args(kind) if a is not Ellipsis]
    return bool(items) and all(a is float for a in items)
