"""Flat keyword arguments that moved into config objects: accepted for one release, with a
``DeprecationWarning`` that names the config to use instead."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any


def split_legacy(legacy: Mapping[str, Any], configs: Sequence[tuple[str, Any]], *, owner: str) -> list[Any]:
    """Each of ``configs`` (``(argument name, config)`` pairs, a frozen dataclass each) with
    the flat keywords of ``legacy`` that name one of its fields applied on top.

    ``TransformersEngine(kv_slots=4)`` becomes ``kv=KVConfig(kv_slots=4)``: the warning says
    so. Values are validated by the config, as if given there.

    Raises:
        TypeError: a keyword that is no field of any config (as a signature would).
    """
    left = dict(legacy)
    out = []
    for arg, config in configs:
        names = {f.name for f in dataclasses.fields(config)}
        mine = {k: left.pop(k) for k in list(left) if k in names}
        if mine:
            spelled = ", ".join(f"{k}=..." for k in mine)
            warnings.warn(
                f"{owner}({spelled}) is deprecated; pass {arg}={type(config).__name__}({spelled})",
                DeprecationWarning,
                stacklevel=3,
            )
            config = dataclasses.replace(config, **mine)
        out.append(config)
    if left:
        raise TypeError(f"{owner}() got an unexpected keyword argument {next(iter(left))!r}")
    return out


def warn_moved(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that the name ``old`` moved to ``new``, unless the code asking is convo's own.

    Other parts of convo still import a few old names while they move in this release; a
    warning there would fire on ``import convo`` and fail programs that turn warnings into
    errors, for code they do not own. ``stacklevel`` counts from the caller of this
    function, as :func:`warnings.warn` does (3: whoever called the module ``__getattr__``
    that calls this).
    """
    frame = sys._getframe(stacklevel - 1)
    module = str(frame.f_globals.get("__name__", ""))
    if module == "convo" or module.startswith("convo."):
        return
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)
