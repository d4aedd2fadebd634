"""A grid of predictions: every (context, concurrency) cell of ``convo plan`` priced by
a :class:`~convo.planner.memory.VRAMModel`, and what is safe on a device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from convo.errors import ConfigError
from convo.models.units import parse_size
from convo.planner.memory import CellPrediction, VRAMModel


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A grid of predictions and what is safe."""

    model: str
    memory_bytes: int
    cells: tuple[CellPrediction, ...]
    weights_bytes: int
    kv_bytes_per_token: int
    calibration_source: str
    kv_slots: int | str | None = None  # a number, "auto" (the engine's choice per context) or None
    load_peak_bytes: int = 0

    def max_safe_concurrency(self) -> dict[int, int]:
        """Per context: the largest concurrency of the grid that is safe (0: none); with KV
        slots, the requests that run at once (at most the slots; more queue)."""
        return self._largest_safe(by="context", value="running")

    def max_safe_context(self) -> dict[int, int]:
        """Per concurrency: the largest context of the grid that is safe (0: none)."""
        return self._largest_safe(by="concurrency", value="context")

    def _largest_safe(self, *, by: str, value: str) -> dict[int, int]:
        out: dict[int, int] = {}
        for c in self.cells:
            key = getattr(c, by)
            out[key] = max(out.get(key, 0), getattr(c, value) if c.safe else 0)
        return out


def plan_grid(
    mm: VRAMModel,
    *,
    model: str,
    contexts: Sequence[int],
    concurrencies: Sequence[int],
    memory_bytes: int,
    new_tokens: int = 256,
    kv_slots: int | str | None = None,
) -> Plan:
    """Predict every (context, concurrency) cell against ``memory_bytes``.

    ``kv_slots``: a slot pool of that many slots of each cell's context, or ``"auto"``:
    as many as the engine takes by default (:meth:`VRAMModel.auto_kv_slots`, per context).
    """
    if kv_slots is not None and kv_slots != "auto" and not isinstance(kv_slots, int):
        raise ConfigError(f"kv_slots must be a number of slots or 'auto', not {kv_slots!r}")

    def slots(ctx: int) -> int | None:
        if kv_slots == "auto":
            return mm.auto_kv_slots(memory_bytes, ctx)
        return kv_slots if isinstance(kv_slots, int) else None

    cells = tuple(
        mm.predict(
            context=ctx,
            concurrency=conc,
            new_tokens=new_tokens,
            memory_bytes=memory_bytes,
            kv_slots=slots(ctx),
        )
        for ctx in contexts
        for conc in concurrencies
    )
    return Plan(
        model=model,
        memory_bytes=memory_bytes,
        cells=cells,
        weights_bytes=mm.weights.total_bytes,
        kv_bytes_per_token=mm.kv_bytes_per_token(),
        calibration_source=mm.calibration.source,
        kv_slots=kv_slots,
        load_peak_bytes=mm.weights.load_peak_bytes,
    )


def parse_int_list(text: str, what: str) -> list[int]:
    """The sorted, distinct positive integers of a comma-separated grid axis (``--context
    1024,4k``: sizes with a unit are read as :func:`~convo.models.units.parse_size`).

    Raises:
        ConfigError: not integers, or not positive; ``what`` names the option.
    """
    try:
        values = [int(parse_size(v)) if v.strip()[-1:].isalpha() else int(v) for v in text.split(",")]
    except (ValueError, IndexError):
        raise ConfigError(f"--{what} takes comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"--{what} values must be positive, got {text!r}")
    return sorted(set(values))


#: Deprecated name of :func:`parse_int_list`.
_parse_int_list = parse_int_list
