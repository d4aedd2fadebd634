"""Sizing a server to a memory limit: the KV slots and int4 layout that fit (``convo serve
--gpu-memory 24GiB``, ``--gpu-memory-utilization 0.9``, ``KVConfig(gpu_memory=...)``).

The static decoder's memory is fixed at load: the weights, a pool of ``slots`` KV slots of
``slot_tokens`` tokens, the captured steps' buffers and one step's prefill activations
(:meth:`~convo.planner.memory.VRAMModel.predict` with ``kv_slots``). :func:`fit_serve`
prices that for every slot count and keeps the largest whose predicted peak reserved, and
load peak, stay under the limit minus a headroom::

    | weights | KV pool (slots x slot_tokens) | graphs + prefill x ratio | headroom |
    |<------------------------------- memory limit ----------------------------->|

The headroom (:func:`headroom_bytes`: :data:`FIT_HEADROOM_FRACTION` of the limit, at least
:data:`FIT_MIN_HEADROOM_BYTES`) is for what the planner does not see: the CUDA context and
libraries outside PyTorch's allocator on a real card, and the planner's own error
(measured within +-10 %, never under, on the H200; ``benchmarks/fit_gpu.py``).

int4 keeps two copies of its weights by default (:mod:`convo.fast.int4`: tinygemm's layout
for steps of up to 8 rows, the plain one for the Triton kernel and prefill). Where memory
is tight a sized server keeps one, the plain layout (``int4_kernel="triton"``): the second
copy of a 7B model (~3.8-4.4 GiB) is worth 4 KV slots of 2,048 tokens of Llama-2-7B. The speed given up:
a decode step of one to a few rows runs the Triton kernel instead of tinygemm's (H200,
Llama-2-7B: 5.8 ms against 3.2 ms a step at 1 row, ~1.8x slower; at 16 rows the Triton
kernel is the faster one, 8.5 against 10.5 ms, so a full server loses nothing); prefill is
unchanged (the plain layout, dequantized for cuBLAS, in both cases). Both layouts are kept
when the second copy takes at most :data:`INT4_SECOND_LAYOUT_MAX_SHARE` of the memory the
KV pool would get with one layout, or costs no slot.

Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from convo.errors import ConfigError
from convo.models.quant import Quant
from convo.models.spec import DType
from convo.models.units import MiB, format_size, parse_size
from convo.planner.allocator import segment_bytes
from convo.planner.calibration import Calibration
from convo.planner.memory import CellPrediction, VRAMModel
from convo.planner.weights import INT4_CUDA_LAYOUTS

#: Share of the memory limit a sized server leaves free above the planner's predicted peak.
FIT_HEADROOM_FRACTION = 0.05
#: The least headroom (bytes): a CUDA context and cuBLAS/NCCL handles take ~0.3-0.5 GiB of
#: a real card outside PyTorch's allocator.
FIT_MIN_HEADROOM_BYTES = 512 * MiB
#: Most KV slots sizing picks (vLLM's ``max_num_seqs`` default is 256). The graphs of all
#: batch buckets share one pool (about the largest one's memory), but each bucket more is
#: more captures at warm-up. Pass ``--kv-slots`` for more.
FIT_MAX_KV_SLOTS = 512
#: With int4 and ``int4_kernel="auto"``, both weight layouts are kept when the second copy
#: takes at most this share of the memory the KV pool gets with one layout (a 7B model: one
#: layout on a 24 GB card, both from ~40 GB), or when it costs no slot (the slots are at
#: their most either way). Decided on bytes, not slots, so bf16 and fp8 KV choose alike.
INT4_SECOND_LAYOUT_MAX_SHARE = 0.2
#: ``--gpu-memory-utilization`` / ``gpu_memory_utilization``: the share of the device's total
#: memory, as vLLM spells it (its default is 0.9).
GPU_MEMORY_UTILIZATION_RANGE = (0.05, 1.0)


def headroom_bytes(memory_bytes: int) -> int:
    """The memory a sized server leaves free: :data:`FIT_HEADROOM_FRACTION` of the limit,
    at least :data:`FIT_MIN_HEADROOM_BYTES`."""
    return max(int(memory_bytes * FIT_HEADROOM_FRACTION), FIT_MIN_HEADROOM_BYTES)


@dataclass(frozen=True, kw_only=True)
class ServeFit:
    """What a server sized to ``memory_bytes`` takes.

    Attributes:
        memory_bytes: the limit (``--gpu-memory``, or the utilization times the total).
        usable_bytes: the limit minus :func:`headroom_bytes`: what the plan must stay under.
        kv_slots: KV slots of ``slot_tokens`` tokens.
        slot_tokens: tokens per slot (the session budget).
        quant: the weight format priced (``auto`` resolved: ``nf4`` on CUDA).
        kv_dtype: the KV slots' dtype.
        int4_layouts: int4 weight copies kept (2: ``int4_kernel="auto"``, 1: one layout),
            0 for other formats.
        int4_kernel: what to pass as ``int4_kernel`` (``"auto"``: both layouts, or the one
            asked; ``"triton"``: the plain layout alone, chosen because memory is tight).
        prediction: the planner's cell: ``slots`` running requests of ``slot_tokens``.
        load_peak_bytes: the most the weights take while loading.
        explicit_slots: the slots were given (checked), not picked.
        weights_reserved_bytes: what the allocator reserves for the weights once loaded
            (:meth:`~convo.planner.memory.VRAMModel.weights_reserved_bytes`); with the pool,
            :attr:`load_end_reserved_bytes`.
    """

    memory_bytes: int
    usable_bytes: int
    kv_slots: int
    slot_tokens: int
    quant: Quant
    kv_dtype: DType
    int4_layouts: int
    int4_kernel: str
    prediction: CellPrediction
    load_peak_bytes: int
    explicit_slots: bool = False
    weights_reserved_bytes: int = 0

    @property
    def load_end_reserved_bytes(self) -> int:
        """Reserved once the weights loaded and the KV pool was taken, before the warm-up:
        the weights' reserved bytes and the pool (one allocation of its own, its segment
        rounded up to 2 MiB: an fp8 pool's scales make its size odd)."""
        return self.weights_reserved_bytes + segment_bytes(self.prediction.kv_bytes)

    @property
    def peak_reserved_bytes(self) -> int:
        """The predicted steady peak reserved (weights, pool, graphs, prefill)."""
        return self.prediction.peak_reserved_bytes

    def describe(self) -> str:
        """One line for the server's log: what was picked and what it is predicted to take."""
        layout = ""
        if self.quant is Quant.INT4:
            layout = (
                ", int4 both layouts" if self.int4_layouts == 2 else f", int4 one layout ({self.int4_kernel})"
            )
        how = "asked" if self.explicit_slots else "picked"
        return (
            f"{self.kv_slots} KV slots of {self.slot_tokens} tokens ({how}; {self.quant.value}{layout}, "
            f"KV {self.kv_dtype.value}): predicted peak {format_size(self.peak_reserved_bytes)} reserved, "
            f"load peak {format_size(self.load_peak_bytes)}, in {format_size(self.memory_bytes)} "
            f"less {format_size(self.memory_bytes - self.usable_bytes)} headroom"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able summary (``convo plan --json``'s ``gpu_memory_pick`` entries)."""
        return {
            "kv_slots": self.kv_slots,
            "slot_tokens": self.slot_tokens,
            "quant": self.quant.value,
            "kv_dtype": self.kv_dtype.value,
            "int4_layouts": self.int4_layouts,
            "int4_kernel": self.int4_kernel,
            "memory_bytes": self.memory_bytes,
            "usable_bytes": self.usable_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "load_peak_bytes": self.load_peak_bytes,
            "weights_bytes": self.prediction.weights_bytes,
            "weights_reserved_bytes": self.weights_reserved_bytes,
            "load_end_reserved_bytes": self.load_end_reserved_bytes,
            "kv_pool_bytes": self.prediction.kv_bytes,
        }


def memory_limit_bytes(
    gpu_memory: int | str | None, utilization: float | None, total_bytes: int | None
) -> int | None:
    """The limit a server sizes itself to: ``gpu_memory`` (bytes, or a size with a unit),
    or ``utilization`` times the device's ``total_bytes``; ``None`` when neither is given.

    Raises:
        ConfigError: both given, a size without a unit, a utilization out of
            :data:`GPU_MEMORY_UTILIZATION_RANGE`, or a utilization without a device total.
    """
    if gpu_memory is not None and utilization is not None:
        raise ConfigError("give --gpu-memory or --gpu-memory-utilization, not both")
    if gpu_memory is not None:
        if isinstance(gpu_memory, int):
            limit = gpu_memory
        else:
            try:
                limit = parse_size(str(gpu_memory), unit_required=True)
            except ConfigError as exc:
                raise ConfigError(f"--gpu-memory: {exc}") from None
        if limit <= 0:
            raise ConfigError("--gpu-memory must be positive")
        return limit
    if utilization is None:
        return None
    lo, hi = GPU_MEMORY_UTILIZATION_RANGE
    if not lo <= utilization <= hi:
        raise ConfigError(f"--gpu-memory-utilization must be in [{lo}, {hi}], got {utilization}")
    if total_bytes is None:
        raise ConfigError("--gpu-memory-utilization needs a CUDA device; give --gpu-memory SIZE instead")
    return int(utilization * total_bytes)


def planned_kv_dtype(value: object) -> DType | None:
    """A KV dtype setting as the planner prices it: ``None``, ``"auto"`` or anything that is
    not a :class:`~convo.models.spec.DType` spelling means the compute dtype (``None``)."""
    if value is None or str(value).lower() in ("auto", "none", ""):
        return None
    try:
        return DType.parse(str(value))
    except ConfigError:
        return None


def fit_serve(
    config: Mapping[str, Any],
    *,
    memory_bytes: int,
    slot_tokens: int,
    quant: Quant | str = Quant.AUTO,
    kv_dtype: DType | str | None = None,
    kv_slots: int | None = None,
    int4_kernel: str = "auto",
    calibration: Calibration | None = None,
    max_slots: int = FIT_MAX_KV_SLOTS,
) -> ServeFit:
    """The KV slots (and int4 layouts) a CUDA server of ``config`` takes in ``memory_bytes``.

    Args:
        config: the model's config dict (:func:`~convo.models.spec.load_config`).
        memory_bytes: the memory limit.
        slot_tokens: tokens per slot (the server's budget).
        quant: the weight format (``auto``: nf4, as on CUDA).
        kv_dtype: the slots' dtype (default: the compute dtype).
        kv_slots: given slots are checked, not picked.
        int4_kernel: ``"auto"`` lets memory choose one layout or both (see the module
            docstring); ``"triton"`` or ``"tinygemm"`` keep that one.
        calibration: the planner's constants (default: built in).
        max_slots: the most slots picked (:data:`FIT_MAX_KV_SLOTS`).

    Returns:
        A :class:`ServeFit`.

    Raises:
        ConfigError: it cannot fit (or the given slots do not), naming the largest safe
            setting: the slots, else the budget one slot of which fits.
    """
    q = Quant.parse(quant).resolved(cuda=True)
    kv_dtype = planned_kv_dtype(kv_dtype)
    if kv_slots is not None and kv_slots < 1:
        raise ConfigError("a server sized to a memory limit needs KV slots: --kv-slots must be >= 1")
    usable = memory_bytes - headroom_bytes(memory_bytes)
    layouts = (
        [INT4_CUDA_LAYOUTS, 1] if q is Quant.INT4 and int4_kernel == "auto" else [1 if q is Quant.INT4 else 0]
    )
    fits: list[ServeFit] = []
    pool_room: dict[int, int] = {}  # layouts -> bytes the KV pool may take
    weights: dict[int, float] = {}  # layouts -> the weights' reserved bytes
    for n_layouts in layouts:
        mm = VRAMModel.from_config(
            config, quant=q, kv_dtype=kv_dtype, calibration=calibration, int4_layouts=max(n_layouts, 1)
        )
        kernel = int4_kernel if n_layouts != 1 or int4_kernel != "auto" else "triton"
        first = _cell(mm, slot_tokens, 1, usable)
        pool_room[n_layouts] = usable - (first.peak_reserved_bytes - mm.kv_pool_bytes(1, slot_tokens))
        weights[n_layouts] = mm.weights_reserved_bytes(slot_tokens)
        if kv_slots is not None:
            slots, cell = kv_slots, _cell(mm, slot_tokens, kv_slots, usable)
            ok = bool(cell.safe)
        else:
            slots, cell = _largest_slots(mm, slot_tokens, usable, max_slots)
            ok = slots > 0
        if ok:
            fits.append(
                ServeFit(
                    memory_bytes=memory_bytes,
                    usable_bytes=usable,
                    kv_slots=slots,
                    slot_tokens=slot_tokens,
                    quant=q,
                    kv_dtype=mm.kv_dtype,
                    int4_layouts=n_layouts,
                    int4_kernel=kernel,
                    prediction=cell,
                    load_peak_bytes=mm.weights.load_peak_bytes,
                    explicit_slots=kv_slots is not None,
                    weights_reserved_bytes=int(weights[n_layouts]),
                )
            )
    if len(fits) == 2:  # int4, both layouts fit: keep both where memory is not tight
        both, one = fits
        second = weights[2] - weights[1]
        if (
            both.explicit_slots
            or both.kv_slots >= one.kv_slots
            or second <= INT4_SECOND_LAYOUT_MAX_SHARE * pool_room[1]
        ):
            return both
        return one
    if fits:
        return fits[0]
    raise ConfigError(
        _refusal(config, q, kv_dtype, calibration, memory_bytes, usable, slot_tokens, kv_slots, layouts)
    )


def _cell(mm: VRAMModel, slot_tokens: int, slots: int, usable: int) -> CellPrediction:
    return mm.predict(context=slot_tokens, concurrency=slots, kv_slots=slots, memory_bytes=usable)


def _largest_slots(
    mm: VRAMModel, slot_tokens: int, usable: int, max_slots: int
) -> tuple[int, CellPrediction]:
    """The most slots (up to ``max_slots``) whose cell is safe in ``usable``: ``(0, cell of
    1)`` when not one is. The predicted peak grows with the slots, so a bisection finds it."""
    one = _cell(mm, slot_tokens, 1, usable)
    if not one.safe:
        return 0, one
    lo, hi, best = 1, max_slots, one
    while lo < hi:
        mid = (lo + hi + 1) // 2
        cell = _cell(mm, slot_tokens, mid, usable)
        if cell.safe:
            lo, best = mid, cell
        else:
            hi = mid - 1
    return lo, best


def _refusal(
    config: Mapping[str, Any],
    quant: Quant,
    kv_dtype: DType | str | None,
    calibration: Calibration | None,
    memory_bytes: int,
    usable: int,
    slot_tokens: int,
    kv_slots: int | None,
    layouts: list[int],
) -> str:
    """Why nothing fits, and the largest setting that does: the slots at this budget, else
    the budget of one slot (with the leanest int4 layout)."""
    lean = layouts[-1]
    mm = VRAMModel.from_config(
        config, quant=quant, kv_dtype=kv_dtype, calibration=calibration, int4_layouts=max(lean, 1)
    )
    where = f"{format_size(memory_bytes)} (less {format_size(memory_bytes - usable)} headroom)"
    slots, _ = _largest_slots(mm, slot_tokens, usable, FIT_MAX_KV_SLOTS)
    if kv_slots is not None:
        need = _cell(mm, slot_tokens, kv_slots, usable)
        head = (
            f"--kv-slots {kv_slots} of {slot_tokens} tokens ({quant.value}) needs "
            f"{format_size(max(need.peak_reserved_bytes, mm.weights.load_peak_bytes))}, more than {where}"
        )
        if slots:
            return f"{head}; the largest safe setting is --kv-slots {slots}"
    else:
        one = _cell(mm, slot_tokens, 1, usable)
        head = (
            f"one KV slot of {slot_tokens} tokens ({quant.value}) needs "
            f"{format_size(max(one.peak_reserved_bytes, mm.weights.load_peak_bytes))}, more than {where}"
        )
    budget = _largest_budget(mm, usable, slot_tokens)
    if budget:
        return f"{head}; the largest safe setting is --kv-slots 1 --budget {budget}"
    weights = mm.weights.total_bytes
    return (
        f"{head}; the weights alone ({format_size(weights)}, load peak "
        f"{format_size(mm.weights.load_peak_bytes)}) leave no room: a bigger limit, or smaller "
        "weights (--quant nf4 or int4)"
    )


#: The smallest budget :func:`fit_serve` suggests when one slot of the asked budget does not fit.
MIN_SUGGESTED_BUDGET_TOKENS = 256


def _largest_budget(mm: VRAMModel, usable: int, slot_tokens: int) -> int:
    """The largest budget (a multiple of 256 tokens, below ``slot_tokens``) one slot of
    which fits, or 0."""
    step = MIN_SUGGESTED_BUDGET_TOKENS
    lo, hi = 0, (slot_tokens - 1) // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _cell(mm, mid * step, 1, usable).safe:
            lo = mid
        else:
            hi = mid - 1
    return lo * step
