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
        raise StoreError(f"cannot read {path}: {exc}; check the path, or {DAMAGED_HINT}") from exc


#: What a :class:`~convo.errors.StoreError` about a damaged saved file tells the caller to do.
DAMAGED_HINT = "restore the folder from a backup, or delete it and index the turns again"


def damaged(path: Path, problem: str) -> StoreError:
    """The error for a saved file that cannot be used: where, what, and what to do."""
    return StoreError(f"{path}: {problem}; {DAMAGED_HINT}")


def child_folder(parent: Path, name: object) -> Path:
    """``parent / name`` for a folder name read from a saved file, checked to stay inside
    ``parent``: a plain name (no ``/``, ``..`` or absolute path), and no link that leads out.

    Raises:
        StoreError: ``name`` is not such a name.
    """
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or Path(name).name != name
        or "\\" in name
    ):
        raise damaged(parent, f"folder name {name!r} is not a plain name inside it")
    child = parent / name
    if not child.resolve().is_relative_to(parent.resolve()):
        raise damaged(parent, f"folder {name!r} leads outside it")
    return child
