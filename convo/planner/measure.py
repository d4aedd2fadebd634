"""Measuring real peaks on a GPU: a random-weight model of a real architecture, the
grid of ``generate`` calls behind ``convo plan --measure``, and the calibration fitted
from them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from convo.models.random_model import build_random_model
from convo.models.units import GiB
from convo.planner.calibration import Calibration
from convo.planner.memory import CellPrediction, VRAMModel, kv_generations

__all__ = ["MeasuredCell", "build_random_model", "fit_calibration", "generate_exactly", "measure_cells"]

# --------------------------------------------------------------------------------------
# Measurement (GPU): the calibration run
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MeasuredCell:
    """One measured ``generate``: absolute peaks of the process (weights included)."""

    context: int
    concurrency: int
    new_tokens: int
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    seconds: float
    oom: bool


def generate_exactly(model: Any, ids: Any, new_tokens: int) -> None:
    """Stock Hugging Face ``model.generate``: exactly ``new_tokens`` greedy tokens after each
    row of ``ids`` (no early stop, no padding), as the memory measurement and the decode
    benchmark time it."""
    import torch

    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def measure_cells(
    model: Any,
    *,
    contexts: Sequence[int],
    concurrencies: Sequence[int],
    new_tokens: int = 16,
    skip_above_bytes: int | None = None,
    predicted: Mapping[tuple[int, int], CellPrediction] | None = None,
    log: Any = None,
) -> list[MeasuredCell]:
    """Run ``generate`` for each cell and record the peaks (CUDA).

    For each (context, concurrency): empty the cache, reset peak stats, generate
    ``new_tokens`` greedy tokens (no early stop) from a random prompt of
    ``context - new_tokens`` tokens per row, read ``max_memory_allocated`` and
    ``max_memory_reserved``; an OOM marks the cell. Cells whose *predicted* reserved peak
    exceeds ``skip_above_bytes`` are marked OOM without running (saves minutes).
    """
    import gc

    import torch

    vocab = int(model.config.vocab_size)
    dev = next(model.parameters()).device
    out: list[MeasuredCell] = []
    gen = torch.Generator(device="cpu").manual_seed(0)

    def cell(
        ctx: int, conc: int, allocated: int | None, reserved: int | None, seconds: float
    ) -> MeasuredCell:
        """A cell's record; no allocated peak: out of memory."""
        return MeasuredCell(
            context=ctx,
            concurrency=conc,
            new_tokens=new_tokens,
            peak_allocated_bytes=allocated,
            peak_reserved_bytes=reserved,
            seconds=seconds,
            oom=allocated is None,
        )

    def one(ctx: int, conc: int) -> MeasuredCell:
        prompt = max(ctx - new_tokens, 1)
        ids = torch.randint(3, vocab, (conc, prompt), generator=gen).to(dev)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        allocated: int | None = None
        try:
            generate_exactly(model, ids, new_tokens)
            torch.cuda.synchronize()
            allocated = int(torch.cuda.max_memory_allocated())
        except torch.OutOfMemoryError:
            pass
        seconds = time.perf_counter() - t0
        reserved = int(torch.cuda.max_memory_reserved())
        del ids
        gc.collect()
        torch.cuda.empty_cache()
        return cell(ctx, conc, allocated, reserved, seconds)

    one(64 + new_tokens, 1)  # warm-up: cuBLAS handles, kernels
    for ctx in contexts:
        for conc in concurrencies:
            pred = (predicted or {}).get((ctx, conc))
            if (
                skip_above_bytes is not None
                and pred is not None
                and pred.peak_reserved_bytes > 1.3 * skip_above_bytes
            ):
                out.append(cell(ctx, conc, None, None, 0.0))  # (marked OOM)
            else:
                out.append(one(ctx, conc))
            measured = out[-1]
            if log is not None:
                log(
                    f"measured {ctx}x{conc}: alloc={measured.peak_allocated_bytes} "
                    f"reserved={measured.peak_reserved_bytes} oom={measured.oom} {measured.seconds:.1f}s"
                )
    return out


def fit_calibration(
    mm: VRAMModel,
    cells: Sequence[MeasuredCell],
    *,
    weights_allocated: int,
    weights_reserved: int,
    source: str,
) -> Calibration:
    """Re-fit the calibration from measured cells.

    * activations: ``act_hidden_factor`` by least squares (through the origin, weighted
      by tokens) on ``peak allocated - weights - KV - workspace`` against prompt tokens;
    * ``prefill_reserved_ratio``: the 75th percentile of reserved/allocated above the
      weights over cells of >= 2 GiB whose KV does not outgrow its segments (small cells
      sit at 1.06-1.09 and would pull it down);
    * ``weights_reserved_ratio``: reserved/allocated right after loading.
    """
    ok = [c for c in cells if not c.oom and c.peak_allocated_bytes and c.peak_reserved_bytes]
    base = mm.calibration
    if not ok:
        return base
    num = den = 0.0
    for c in ok:
        prompt = c.context - c.new_tokens
        n = prompt * c.concurrency
        kv = mm.shape.kv_bytes(prompt, c.concurrency, mm.kv_dtype, cap_windows=False)
        extra = int(c.peak_allocated_bytes or 0) - weights_allocated - kv - mm.workspace_bytes()
        num += extra * n
        den += n * n
    per_token = max(num / den, 0.0) if den else mm.act_bytes_per_token()
    s = mm.shape
    dt = mm.compute_dtype.nbytes
    hidden_factor = max(
        (per_token / dt - base.act_intermediate_factor * s.intermediate_size) / s.hidden_size, 0.0
    )
    ratios: list[float] = []
    for c in ok:
        prompt = c.context - c.new_tokens
        per_tensor_token = c.concurrency * s.num_kv_heads * s.head_dim * mm.kv_dtype.nbytes
        above_alloc = int(c.peak_allocated_bytes or 0) - weights_allocated
        if above_alloc < 2 * GiB or kv_generations(per_tensor_token, prompt, c.new_tokens):
            continue
        ratios.append((int(c.peak_reserved_bytes or 0) - weights_reserved) / above_alloc)
    ratios.sort()
    prefill_ratio = (
        ratios[min(len(ratios) - 1, int(0.75 * len(ratios)))] if ratios else base.prefill_reserved_ratio
    )
    return dataclasses.replace(
        base,
        act_hidden_factor=round(hidden_factor, 3),
        prefill_reserved_ratio=round(max(prefill_ratio, 1.0), 4),
        weights_reserved_ratio=round(max(weights_reserved / max(weights_allocated, 1), 1.0), 4),
        source=source,
    )


def _device_info() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in ("torch", "transformers", "bitsandbytes", "accelerate"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["device"] = props.name
            info["device_memory_bytes"] = int(props.total_memory)
            info["cuda"] = torch.version.cuda
        else:
            info["device"] = "cpu"
    except ImportError:
        info["device"] = "cpu"
    return info
