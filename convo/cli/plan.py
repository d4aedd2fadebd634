"""``convo plan``: will this model fit context N with M sessions on this GPU?"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from convo.cli.common import (
    add_int4_kernel_argument,
    add_kv_host_memory_argument,
    non_negative_int,
)
from convo.errors import ConfigError, require
from convo.models import (
    AUTO_SLOTS_MEMORY_FRACTION,
    BUILTIN_CONFIGS,
    DEFAULT_KV_SLOTS,
    Attn,
    DType,
    GiB,
    Quant,
    format_size,
    load_config,
    model_key,
    parse_size,
)
from convo.models.defaults import DEFAULT_CPU_KV_SLOTS, resolve_kv_host_memory
from convo.models.spec import STATIC_DECODE_MODEL_TYPES
from convo.planner.calibration import Calibration, calibration_path, find_calibration, load_calibration
from convo.planner.fit import ServeFit, fit_serve, headroom_bytes
from convo.planner.grid import Plan, parse_int_list, plan_grid
from convo.planner.measure import (
    MeasuredCell,
    _device_info,
    build_random_model,
    fit_calibration,
    measure_cells,
)
from convo.planner.memory import CellPrediction, VRAMModel
from convo.planner.weights import INT4_CUDA_LAYOUTS, planned_quant

#: What ``convo plan`` plans against when no ``--gpu-memory`` is given and no GPU is visible.
DEFAULT_PLAN_MEMORY = "24GiB"

# --------------------------------------------------------------------------------------
# CLI: convo plan
# --------------------------------------------------------------------------------------


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the flags of ``convo plan`` on ``parser``."""
    parser.add_argument(
        "--model",
        default="default",
        help="model folder, config.json, random:<folder or config.json>, 'default' (SmolLM2-135M) or "
        "one of: " + ", ".join(sorted(k for k in BUILTIN_CONFIGS if k != "default")),
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "cpu"],
        help="the device whose convo serve defaults are planned (default auto: cuda when a GPU is "
        "visible or --gpu-memory is given, else cpu)",
    )
    parser.add_argument(
        "--context", default="1024,4096,8192", help="comma-separated tokens per request, prompt + reply"
    )
    parser.add_argument(
        "--concurrency", default="1,4,16", help="comma-separated numbers of requests in flight (batch rows)"
    )
    parser.add_argument(
        "--gpu-memory",
        default=None,
        help="device memory to plan against, with a unit: 24GiB, 80GB, 24000MiB (default: the total "
        f"memory of CUDA device 0 when one is visible, else {DEFAULT_PLAN_MEMORY})",
    )
    parser.add_argument(
        "--quant",
        default=None,
        choices=[q.value for q in Quant],
        help="weight format (default: convo serve's, auto: nf4 on CUDA, fp32 on CPU): none/bf16/fp16/"
        "fp32 (dense), nf4/fp4/int8 (bitsandbytes), int4 (the fast path of convo serve --quant int4: "
        "group-wise int4, static KV slots)",
    )
    parser.add_argument(
        "--kv-slots",
        type=non_negative_int,
        default=None,
        help="plan convo serve's static KV slot pool: N slots of each cell's context tokens, taken "
        "at load; requests beyond N queue instead of taking memory; 0: transformers' generate with "
        "one growing cache per request (default: as convo serve takes them: on CUDA up to "
        f"{DEFAULT_KV_SLOTS} as the memory allows, on CPU {DEFAULT_CPU_KV_SLOTS} with --quant int4, "
        "else 0)",
    )
    add_int4_kernel_argument(parser)
    add_kv_host_memory_argument(parser)
    parser.add_argument(
        "--dtype", default=None, help="dtype of unquantized weights and activations (default: config's)"
    )
    parser.add_argument(
        "--kv-dtype",
        default=None,
        help=f"KV cache dtype: {', '.join(DType)} (default: --dtype); a slot pool (--kv-slots, "
        "--quant int4) is in --dtype or fp8, as convo serve --kv-dtype fp8 stores it (with a "
        "bfloat16 scale per token and head)",
    )
    parser.add_argument("--attn", default="sdpa", choices=[a.value for a in Attn])
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="reply tokens per request (default 256; 16 with --measure)",
    )
    parser.add_argument(
        "--calibration",
        default="auto",
        help="calibration JSON, 'auto' (newest cached for this model) or 'none'",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="run every cell on the GPU with random weights, print predicted "
        "vs measured and write a calibration",
    )
    parser.add_argument(
        "--out", default=None, help="with --measure: folder for plan_measure.json and calibration.json"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """The memory ``convo plan`` plans against and where that number comes from."""

    total_bytes: int
    source: str  # e.g. "--gpu-memory", "NVIDIA H200 (CUDA device 0)", "default: no GPU visible"
    free_bytes: int | None = None  # free on the device now (CUDA only)


def cuda_device_memory() -> DeviceMemory | None:
    """Total and free memory of CUDA device 0, or ``None`` when no GPU is visible (or
    torch is not installed). Imports torch only when it is installed."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(0)
    name = torch.cuda.get_device_name(0)
    return DeviceMemory(
        total_bytes=int(total),
        source=f"the total of {name}, CUDA device 0; {format_size(free)} free now",
        free_bytes=int(free),
    )


def plan_memory(flag: str | None) -> DeviceMemory:
    """``--gpu-memory`` (a unit is required), else the GPU's total memory, else
    :data:`DEFAULT_PLAN_MEMORY`.

    Raises:
        ConfigError: a size without a unit or otherwise unparseable.
    """
    if flag is not None:
        try:
            return DeviceMemory(total_bytes=parse_size(flag, unit_required=True), source="--gpu-memory")
        except ConfigError as exc:
            raise ConfigError(f"--gpu-memory: {exc}") from None
    found = cuda_device_memory()
    if found is not None:
        return found
    return DeviceMemory(
        total_bytes=parse_size(DEFAULT_PLAN_MEMORY),
        source=f"default {DEFAULT_PLAN_MEMORY}: no GPU visible, pass --gpu-memory",
    )


def planned_device(device: str, gpu_memory: str | None) -> str:
    """The device whose ``convo serve`` defaults ``convo plan`` prices: ``--device``, or
    ``auto``: ``cuda`` when ``--gpu-memory`` is given or a GPU is visible, else ``cpu``."""
    if device != "auto":
        return device
    return "cuda" if gpu_memory is not None or cuda_device_memory() is not None else "cpu"


def serve_quant(quant: str | None, device: str) -> str:
    """The weight format ``convo serve`` loads on ``device`` for ``--quant`` (``None``: its
    default, ``auto``): nf4 on CUDA, fp32 on CPU."""
    return Quant.parse(quant or Quant.AUTO.value).resolved(cuda=device == "cuda").value


def serve_kv_slots(kv_slots: int | None, quant: Quant, model_type: str, device: str) -> int | str | None:
    """The KV slots ``convo serve`` takes (what :class:`~convo.engines.local.TransformersEngine`
    does with ``kv_slots``): a given count (0: none, plain ``generate``), else on CUDA
    ``"auto"`` (up to :data:`~convo.models.DEFAULT_KV_SLOTS` as the memory allows) for an
    architecture the static decoder runs, on CPU :data:`~convo.models.DEFAULT_CPU_KV_SLOTS`
    for int4, else none.

    Raises:
        ConfigError: ``--kv-slots 0`` with int4 (which runs only in slots).
    """
    if kv_slots == 0:
        if quant is Quant.INT4:
            raise ConfigError("--quant int4 runs only on KV slots: --kv-slots must be >= 1")
        return None
    if kv_slots is not None:
        return kv_slots
    if quant is Quant.INT4:
        return "auto" if device == "cuda" else DEFAULT_CPU_KV_SLOTS
    return "auto" if device == "cuda" and model_type in STATIC_DECODE_MODEL_TYPES else None


def _build_memory_model(args: argparse.Namespace) -> tuple[VRAMModel, str]:
    quant, dtype = planned_quant(args.quant, args.dtype)
    attn = Attn.parse(args.attn)
    cal: Calibration | None = None
    source = str(getattr(args, "calibration", "auto") or "auto")
    if source == "auto":
        path = find_calibration(model_key(args.model), quant, attn)
        if path is not None:
            cal = load_calibration(path)
    elif source != "none":
        cal = load_calibration(source)
    mm = VRAMModel.from_model(
        args.model,
        quant=quant,
        dtype=dtype,
        kv_dtype=args.kv_dtype,
        attn=attn,
        calibration=cal,
        int4_layouts=INT4_CUDA_LAYOUTS
        if getattr(args, "int4_kernel", "auto") == "auto"
        and getattr(args, "planned_device", "cuda") == "cuda"
        else 1,
    )
    return mm, source


def plan_to_json(plan: Plan, mm: VRAMModel, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``--json`` object (field names are a contract; new ones are only added).

    Each cell carries ``headroom_bytes`` (memory minus the reserved peak; negative: over),
    ``kv_slots``, ``running``, ``queued`` and ``reason`` (``"model max N"``: a context beyond
    the model's window, never safe); the plan ``kv_slots`` and ``load_peak_bytes`` (int4:
    the weights kept, one dense layer and its quantization's temporaries).
    """
    return {
        "model": plan.model,
        "memory_bytes": plan.memory_bytes,
        "kv_slots": plan.kv_slots,
        "load_peak_bytes": plan.load_peak_bytes,
        "weights_bytes": plan.weights_bytes,
        "weights_method": mm.weights.method,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "quant": mm.quant.value,
        "dtype": mm.compute_dtype.value,
        "kv_dtype": mm.kv_dtype.value,
        "attn": mm.attn.value,
        "calibration": plan.calibration_source,
        "cells": [dataclasses.asdict(c) for c in plan.cells],
        "max_safe_concurrency": {str(k): v for k, v in plan.max_safe_concurrency().items()},
        "max_safe_context": {str(k): v for k, v in plan.max_safe_context().items()},
        **(extra or {}),
    }


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _signed_gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:+.2f}"


def _safe_mark(c: CellPrediction) -> str:
    if c.reason:
        return f"no ({c.reason})"
    if not c.safe:
        return "NO"
    return f"yes, {c.queued} queue" if c.queued else "yes"


def render_plan_table(
    plan: Plan,
    measured: Mapping[tuple[int, int], MeasuredCell] | None = None,
    *,
    memory_source: str | None = None,
    quant: str | None = None,
    picks: Mapping[int, ServeFit | str] | None = None,
    header: str | None = None,
) -> str:
    """The human table of ``convo plan`` (GiB); ``picks``: per context, what ``convo serve
    --gpu-memory`` would take (or why it cannot); ``header``: a line on what is planned."""
    slots = plan.kv_slots is not None
    head = f"{'context':>8} {'conc':>5}" + (f" {'slots':>5}" if slots else "")
    head += f" {'weights':>8} {'kv':>8} {'act':>7} {'alloc':>8} {'reserved':>9}"
    head += f" {'headroom':>9}  safe"
    if measured:
        head += f" {'m.alloc':>8} {'m.resv':>8} {'err%':>6}"
    memory = format_size(plan.memory_bytes) + (f" ({memory_source})" if memory_source else "")
    lines = [
        f"model {plan.model}{f' ({quant})' if quant else ''}: weights {format_size(plan.weights_bytes)}, "
        f"KV {plan.kv_bytes_per_token:,} B/token, memory {memory}, "
        f"calibration: {plan.calibration_source}",
    ]
    if header:
        lines.append(header)
    if plan.load_peak_bytes > plan.weights_bytes:
        fits = "fits" if plan.load_peak_bytes <= plan.memory_bytes else "does NOT fit: every cell is NO"
        lines.append(
            f"loading takes {format_size(plan.load_peak_bytes)} at its peak (int4: the weights kept, "
            f"one dense layer moved over from host memory and its quantization's temporaries): {fits}"
        )
    if plan.kv_slots == "auto":
        lines.append(
            f"static KV slots as convo serve takes them: up to {DEFAULT_KV_SLOTS} slots of <context> "
            f"tokens, as many as {AUTO_SLOTS_MEMORY_FRACTION:.0%} of the memory left after loading "
            "holds (column 'slots'); kv = the pool, whatever the concurrency; more requests queue"
        )
    elif slots:
        lines.append(
            f"static KV slots: {plan.kv_slots} slots of <context> tokens, taken at load (kv = the "
            f"pool, whatever the concurrency); requests beyond {plan.kv_slots} queue for a slot"
        )
    lines += [
        "sizes in GiB; alloc/reserved are predicted peaks including weights; "
        "headroom = memory - reserved (negative: over)",
        head,
    ]
    for c in plan.cells:
        row = f"{c.context:>8} {c.concurrency:>5}" + (f" {c.kv_slots:>5}" if slots else "")
        row += (
            f" {_gib(c.weights_bytes):>8} {_gib(c.kv_bytes):>8} "
            f"{_gib(c.activation_bytes):>7} {_gib(c.peak_allocated_bytes):>8} "
            f"{_gib(c.peak_reserved_bytes):>9} {_signed_gib(c.headroom_bytes):>9}  {_safe_mark(c):<4}"
        )
        if measured:
            m = measured.get((c.context, c.concurrency))
            if m is None:
                row += f" {'':>8} {'':>8} {'':>6}"
            elif m.oom:
                row += f" {'OOM':>8} {_gib(m.peak_reserved_bytes):>8} {'':>6}"
            else:
                err = (
                    100.0
                    * (c.peak_reserved_bytes - (m.peak_reserved_bytes or 0))
                    / max(m.peak_reserved_bytes or 1, 1)
                )
                row += f" {_gib(m.peak_allocated_bytes):>8} {_gib(m.peak_reserved_bytes):>8} {err:>+6.1f}"
        lines.append(row)
    lines.append(
        (
            "largest safe concurrency per context (running at once; more queue): "
            if slots
            else "largest safe concurrency per context: "
        )
        + ", ".join(f"{k}: {v}" for k, v in plan.max_safe_concurrency().items())
    )
    lines.append(
        "largest safe context per concurrency: "
        + ", ".join(f"{k}: {v}" for k, v in plan.max_safe_context().items())
    )
    if picks:
        head = picks_header(plan.memory_bytes)
        lines.append(head + "; ".join(f"{ctx}: {_pick_text(p)}" for ctx, p in picks.items()))
    return "\n".join(lines)


def picks_header(memory_bytes: int) -> str:
    """The start of the table's line on what ``convo serve --gpu-memory`` would take."""
    return (
        f"convo serve --gpu-memory {format_size(memory_bytes)} --budget <context> would take "
        f"({format_size(headroom_bytes(memory_bytes))} headroom): "
    )


def _pick_text(pick: ServeFit | str) -> str:
    if isinstance(pick, str):
        return pick
    layout = ""
    if pick.int4_layouts:
        layout = ", both int4 layouts" if pick.int4_layouts == 2 else ", one int4 layout"
    return f"{pick.kv_slots} slots{layout} ({_gib(pick.peak_reserved_bytes)} GiB)"


def serve_picks(
    mm: VRAMModel, model: str, contexts: list[int], memory_bytes: int, int4_kernel: str
) -> dict[int, ServeFit | str]:
    """Per context, what ``convo serve --gpu-memory memory_bytes --budget <context>`` takes
    (:func:`~convo.planner.fit.fit_serve`), or why it cannot (a line of text)."""
    if mm.shape.model_type not in STATIC_DECODE_MODEL_TYPES:
        return {}
    config = load_config(model)
    picks: dict[int, ServeFit | str] = {}
    for ctx in contexts:
        if ctx > mm.shape.max_position_embeddings:
            picks[ctx] = f"no (model max {mm.shape.max_position_embeddings})"
            continue
        try:
            picks[ctx] = fit_serve(
                config,
                memory_bytes=memory_bytes,
                slot_tokens=ctx,
                quant=mm.quant if mm.quant is not Quant.NONE else mm.compute_dtype.value,
                kv_dtype=mm.kv_dtype,
                int4_kernel=int4_kernel,
                calibration=mm.calibration,
            )
        except ConfigError as exc:
            picks[ctx] = f"refused: {exc}"
    return picks


def run_plan_cli(args: argparse.Namespace) -> int:
    """Run ``convo plan`` with parsed ``args`` (see :func:`add_plan_arguments`).

    Returns:
        The exit status: 0, or 2 for a configuration error (message on stderr).
    """
    try:
        contexts = parse_int_list(str(args.context), "context")
        concs = parse_int_list(str(args.concurrency), "concurrency")
        device = plan_memory(args.gpu_memory)
        memory = device.total_bytes
        measure = bool(getattr(args, "measure", False))
        new_tokens = args.max_new_tokens if args.max_new_tokens is not None else (16 if measure else 256)
        if new_tokens < 0:
            raise ConfigError("--max-new-tokens must be >= 0")
        target = planned_device(getattr(args, "device", "auto"), args.gpu_memory)
        asked_quant = args.quant
        args.quant = serve_quant(args.quant, target)
        args.planned_device = target
        mm, _ = _build_memory_model(args)
        kv_slots = serve_kv_slots(getattr(args, "kv_slots", None), mm.quant, mm.shape.model_type, target)
        if measure and args.kv_slots is None and mm.quant is not Quant.INT4:
            kv_slots = None  # --measure prices transformers' generate
        if kv_slots is not None and mm.kv_dtype not in (mm.compute_dtype, DType.FP8):
            raise ConfigError("--kv-dtype: the KV slot pool is in the model's dtype (--dtype) or fp8")
        if measure and kv_slots is not None:
            raise ConfigError("--measure runs transformers' generate: not with --kv-slots or --quant int4")
    except ConfigError as exc:
        print(f"convo plan: {exc}", file=sys.stderr)
        return 2
    plan = plan_grid(
        mm,
        model=args.model,
        contexts=contexts,
        concurrencies=concs,
        memory_bytes=memory,
        new_tokens=new_tokens,
        kv_slots=kv_slots,
    )
    if not measure:
        picks = serve_picks(mm, args.model, contexts, memory, args.int4_kernel) if target == "cuda" else {}
        header = _serve_header(asked_quant, getattr(args, "kv_slots", None), mm, kv_slots, target)
        if args.json:
            extra = {
                **_memory_json(device),
                **_host_kv_json(args, kv_slots, _pool_bytes(mm, kv_slots, contexts)),
                "device": target,
                "gpu_memory_pick": {
                    str(k): ({"refused": p} if isinstance(p, str) else p.to_json()) for k, p in picks.items()
                },
            }
            print(json.dumps(plan_to_json(plan, mm, extra), indent=2))
        else:
            label = _quant_label(mm, args.quant)
            print(
                render_plan_table(plan, memory_source=device.source, quant=label, picks=picks, header=header)
            )
            print(_host_kv_line(args, kv_slots, _pool_bytes(mm, kv_slots, contexts)))
        return 0
    return _run_measure(args, mm, plan, contexts, concs, device, new_tokens)


def _serve_header(
    asked_quant: str | None, asked_slots: int | None, mm: VRAMModel, kv_slots: int | str | None, device: str
) -> str | None:
    """The line saying the plan is convo serve's defaults on ``device``, when it is."""
    if asked_quant is not None and asked_slots is not None:
        return None
    slots = (
        "plain generate"
        if kv_slots is None
        else ("KV slots as the engine takes them" if kv_slots == "auto" else f"{kv_slots} KV slots")
    )
    weights = mm.quant.value if mm.quant is not Quant.NONE else mm.compute_dtype.value
    return f"planned as convo serve runs on {device}: {weights}, {slots} (flags given win)"


def _quant_label(mm: VRAMModel, asked: str) -> str:
    if mm.quant is Quant.NONE:
        return f"dense {mm.compute_dtype.value}"
    group = ""
    if mm.quant is Quant.INT4:
        layouts = "tinygemm + plain layouts" if mm.int4_layouts == 2 else "one layout"
        group = f", groups of {mm.int4_group_size}, {layouts}"
    auto = " (auto)" if Quant.parse(asked) is Quant.AUTO else ""
    return f"{mm.quant.value}{auto}{group}"


def _host_kv_bytes(args: argparse.Namespace, kv_slots: int | str | None, pool_bytes: int | None) -> int:
    """Host memory (not device memory) the KV of sessions evicted from their slots may take:
    ``--kv-host-memory``, else what the engine takes on this machine
    (:func:`~convo.models.defaults.resolve_kv_host_memory`: a share of its RAM, at most a
    multiple of ``pool_bytes``, the KV pool at the largest context planned, when the slot
    count is known; on CPU only then); 0 without KV slots."""
    if kv_slots is None or kv_slots == 0:
        return 0
    cuda = getattr(args, "planned_device", "cuda") == "cuda"
    return resolve_kv_host_memory(getattr(args, "kv_host_memory", None), cuda=cuda, pool_bytes=pool_bytes)


def _pool_bytes(mm: VRAMModel, kv_slots: int | str | None, contexts: list[int]) -> int | None:
    """The device's KV pool for ``kv_slots`` slots of the largest context (``None``: the
    slot count is picked per context)."""
    return mm.kv_pool_bytes(kv_slots, max(contexts)) if isinstance(kv_slots, int) and kv_slots else None


def _host_kv_json(
    args: argparse.Namespace, kv_slots: int | str | None, pool_bytes: int | None
) -> dict[str, Any]:
    return {"kv_host_memory_bytes": _host_kv_bytes(args, kv_slots, pool_bytes)}


def _host_kv_line(args: argparse.Namespace, kv_slots: int | str | None, pool_bytes: int | None) -> str:
    host = _host_kv_bytes(args, kv_slots, pool_bytes)
    if not host:
        return "host KV: none (sessions evicted from a KV slot recompute their prompt)"
    return (
        f"host KV: up to {format_size(host)} of host RAM (not device memory) holds the KV of sessions "
        "evicted from their slots (--kv-host-memory)"
    )


def _memory_json(device: DeviceMemory) -> dict[str, Any]:
    return {"memory_source": device.source, "memory_free_bytes": device.free_bytes}


def _run_measure(
    args: argparse.Namespace,
    mm: VRAMModel,
    plan: Plan,
    contexts: list[int],
    concs: list[int],
    device: DeviceMemory,
    new_tokens: int,
) -> int:
    """Measure every cell of ``plan`` on the GPU (random weights) next to its prediction."""
    require("torch", "local")
    import gc

    import torch

    if not torch.cuda.is_available():
        print("convo plan --measure needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    device_memory = int(torch.cuda.get_device_properties(0).total_memory)
    t0 = time.perf_counter()
    model = build_random_model(load_config(args.model), quant=mm.quant, dtype=mm.compute_dtype, attn=mm.attn)
    gc.collect()
    torch.cuda.empty_cache()
    w_alloc = int(torch.cuda.memory_allocated())
    w_res = int(torch.cuda.memory_reserved())
    log(
        f"model built in {time.perf_counter() - t0:.1f}s: weights allocated {format_size(w_alloc)} "
        f"(predicted {format_size(mm.weights.total_bytes)}), reserved {format_size(w_res)}"
    )
    preds = {(c.context, c.concurrency): c for c in plan.cells}
    cells = measure_cells(
        model,
        contexts=contexts,
        concurrencies=concs,
        new_tokens=new_tokens,
        skip_above_bytes=device_memory,
        predicted=preds,
        log=log,
    )
    measured = {(c.context, c.concurrency): c for c in cells}
    info = _device_info()
    cal = fit_calibration(
        mm,
        cells,
        weights_allocated=w_alloc,
        weights_reserved=w_res,
        source=f"measured on {info.get('device')}",
    )
    record = {
        "model": args.model,
        "model_key": model_key(args.model),
        "quant": mm.quant.value,
        "attn": mm.attn.value,
        "dtype": mm.compute_dtype.value,
        "env": info,
        "weights_allocated_bytes": w_alloc,
        "weights_reserved_bytes": w_res,
        "predicted_weights_bytes": mm.weights.total_bytes,
        "prior_calibration": mm.calibration.to_json(),
        "calibration": cal.to_json(),
        "cells": [
            {**dataclasses.asdict(m), "predicted": dataclasses.asdict(preds[(m.context, m.concurrency)])}
            for m in cells
        ],
    }
    path = calibration_path(model_key(args.model), mm.quant, mm.attn, str(info.get("device")))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2))
    except OSError as exc:
        log(f"could not cache calibration at {path}: {exc}")
    if out_dir is not None:
        (out_dir / "plan_measure.json").write_text(json.dumps(record, indent=2))
    summary = plan_to_json(
        plan,
        mm,
        {
            "measured": record["cells"],
            "env": info,
            "weights_allocated_bytes": w_alloc,
            "calibration_written": str(path),
            "refit": cal.to_json(),
            **_memory_json(device),
        },
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        label = _quant_label(mm, args.quant)
        print(render_plan_table(plan, measured, memory_source=device.source, quant=label))
        print(f"calibration written to {path}")
    return 0
