"""convo's one cache folder.

``$CONVO_CACHE_DIR``, else ``$XDG_CACHE_HOME/convo``, else ``~/.cache/convo``. Converted
models live in ``models/``, planner calibrations in ``calibration/``. Nothing is created
at import time.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

#: The environment variable that moves the cache folder.
CACHE_ENV = "CONVO_CACHE_DIR"
#: The old name of :data:`CACHE_ENV`, still read (with a warning) for one release.
_OLD_CACHE_ENV = "CONVO_CACHE"


def cache_dir() -> Path:
    """convo's cache folder (not created): ``$CONVO_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/convo``, else ``~/.cache/convo``."""
    env = os.environ.get(CACHE_ENV)
    if not env and os.environ.get(_OLD_CACHE_ENV):
        warnings.warn(
            f"${_OLD_CACHE_ENV} is deprecated; set ${CACHE_ENV} instead", DeprecationWarning, stacklevel=2
        )
        env = os.environ[_OLD_CACHE_ENV]
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "convo"
