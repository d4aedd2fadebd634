"""Atomic file I/O for retrieval's saved folders.

Every file is written to a temporary name in its folder and moved into place with
:func:`os.replace`, so a reader sees the old file or the new one, never half of one. JSON
is written as UTF-8 with ``indent=1``; nothing is pickled.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from convo.errors import StoreError

#: The version written into every saved retrieval file (``"format"``).
FORMAT = 1


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` all at once: a temporary file, fsync, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (see :func:`write_atomic`)."""
    write_atomic(path, json.dumps(obj, ensure_ascii=False, indent=1).encode("utf-8"))


def read_json(path: Path) -> Any:
    """The JSON value in ``path``.

    Raises:
        StoreError: the file is missing, unreadable or not JSON.
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot read {path}: {exc}") from exc
