"""Memory sizes: parsing ``24GiB`` / ``80GB`` and printing bytes for people."""

from __future__ import annotations

import math
import re

from convo.errors import ConfigError

#: Bytes in a kibibyte, a mebibyte and a gibibyte (binary units, as CUDA reports memory).
KiB = 1024
MiB = 1024**2
GiB = 1024**3

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
}


def parse_size(text: str | int | float, *, unit_required: bool = False) -> int:
    """Parse a memory size into bytes.

    ``24GiB`` and ``24G`` are binary (24 * 2**30), ``80GB`` is decimal (80 * 10**9),
    ``24000MiB``, ``512 MB``, ``100B`` and (unless ``unit_required``) a bare number of
    bytes work too.

    Args:
        text: the size, or a number of bytes.
        unit_required: refuse text without a unit (``"24"``: 24 bytes or 24 GiB?).

    Returns:
        The size in bytes.

    Raises:
        ConfigError: unparseable, no unit when one is required, or not positive.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(f"cannot parse size {text!r}; write e.g. 24GiB, 80GB, 24000MiB")
        bare = match.group(1)
        if unit_required and not unit:
            raise ConfigError(
                f"size {text!r} has no unit (it would mean {bare} bytes); "
                f"write e.g. {bare}GiB, {bare}GB, 24000MiB or 512B"
            )
        value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"size must be positive, got {text!r}")
    return int(value)


def format_size(nbytes: float) -> str:
    """Human-readable binary size: ``3.64 GiB``, ``512.0 MiB``."""
    if abs(nbytes) >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if abs(nbytes) >= MiB:
        return f"{nbytes / MiB:.1f} MiB"
    return f"{nbytes / KiB:.1f} KiB"
