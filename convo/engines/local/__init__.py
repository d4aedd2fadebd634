"""The local engine: a Hugging Face causal LM in this process.

* :mod:`~convo.engines.local.engine` — :class:`TransformersEngine`, the model behind a
  capped, measured ``generate``;
* :mod:`~convo.engines.local.kv` — where its sessions' KV caches live: a growing cache per
  session (``DynamicKV``) or the static slots of :mod:`convo.fast` (``SlotKV``);
* :mod:`~convo.engines.local.loading` — the embedded default model and how a ``--model``
  argument is resolved and loaded.

Importing this package loads no torch; the engine imports it when built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convo._deprecated import lazy

if TYPE_CHECKING:
    from convo.engines.local.engine import TransformersEngine

__all__ = ["TransformersEngine"]

__getattr__ = lazy("convo.engines.local", {"TransformersEngine": "convo.engines.local.engine"})
