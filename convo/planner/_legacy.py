"""Old private names of ``convo.planner.model`` that its callers still import (for one
release, through the deprecated module)."""

from __future__ import annotations

import warnings

from convo.models.quant import INT4_GROUP_SIZE, int4_group_size
from convo.models.spec import model_key
from convo.planner.grid import parse_int_list

#: Was ``convo.planner.model._model_key``: :func:`convo.models.spec.model_key`.
_model_key = model_key
#: Was ``convo.planner.model._parse_int_list``: :func:`convo.planner.grid.parse_int_list`.
_parse_int_list = parse_int_list


def int4_group(in_features: int, preferred: int = INT4_GROUP_SIZE) -> int | None:
    """Deprecated: :func:`convo.models.quant.int4_group_size` (this name's ``preferred``
    defaults to :data:`~convo.models.quant.INT4_GROUP_SIZE`, the engine's)."""
    warnings.warn(
        "int4_group is deprecated; use convo.models.int4_group_size",
        DeprecationWarning,
        stacklevel=2,
    )
    return int4_group_size(in_features, preferred)
