"""The flat input of a static forward: prefill chunks of several turns packed in one
chunk bucket, beside the decode rows of a mixed step.

Layout (``int64``, what a captured graph copies in): ``[ids | positions | slots | lasts]``,
``bucket`` entries each for the first three, then :data:`MIXED_PACK_CHUNKS` ``lasts``, the
row of each chunk's last token (unused entries repeat the last chunk's). Each chunk but the
last takes a whole number of :data:`MIXED_PACK_TOKENS`-token blocks; the last runs to the
bucket's end. A chunk's padding rows (token 0) go on at the positions after its end in its
own slot: they write K/V past what the slot holds, never read before a later token
overwrites it, and their outputs are dropped. A chunk whose blocks would pass the slot's
end starts earlier instead, running again tokens the slot already holds (the same K/V).
"""

from __future__ import annotations

from collections.abc import Sequence

from convo.fast.kv_pool import PrefillChunk
from convo.models.defaults import MIXED_PACK_CHUNKS, MIXED_PACK_TOKENS

__all__ = [
    "MIXED_PACK_CHUNKS",
    "MIXED_PACK_TOKENS",
    "block_rows",
    "pack_chunks",
    "packed_tokens",
    "static_pieces",
]


def block_rows(tokens: int, unit: int = MIXED_PACK_TOKENS) -> int:
    """Rows a chunk of ``tokens`` tokens takes when another is packed after it: whole
    blocks of ``unit`` tokens."""
    return -(-tokens // unit) * unit


def packed_tokens(sizes: Sequence[int], unit: int = MIXED_PACK_TOKENS) -> int:
    """Rows that chunks of ``sizes`` tokens take packed: each but the last in whole blocks
    (:func:`block_rows`)."""
    if not sizes:
        return 0
    return sum(block_rows(n, unit) for n in sizes[:-1]) + sizes[-1]


def pack_chunks(
    chunks: Sequence[PrefillChunk],
    bucket: int,
    slot_tokens: int,
    *,
    unit: int = MIXED_PACK_TOKENS,
    lasts: int = MIXED_PACK_CHUNKS,
) -> list[int] | None:
    """The flat layout (see the module) of ``chunks`` packed in ``bucket`` rows of slots of
    ``slot_tokens`` tokens; ``None`` when they do not fit (more than ``lasts`` chunks, more
    rows than the bucket, or a chunk's rows past its slot however early they start)."""
    if not chunks or len(chunks) > lasts:
        return None
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last: list[int] = []
    for i, c in enumerate(chunks):
        span = bucket - len(ids) if i == len(chunks) - 1 else block_rows(c.end - c.start, unit)
        start = min(c.start, slot_tokens - span)
        if span < c.end - c.start or len(ids) + span > bucket or start < 0:
            return None
        real = list(c.ids[start : c.end])
        last.append(len(ids) + len(real) - 1)
        ids += real + [0] * (span - len(real))
        positions += range(start, start + span)
        slots += [c.slot] * span
    return ids + positions + slots + last + [last[-1]] * (lasts - len(last))


def static_pieces(
    chunk: PrefillChunk, buckets: Sequence[int], slot_tokens: int
) -> list[tuple[int, int, int]] | None:
    """``(start, end, bucket)`` pieces that cover ``chunk``, each run alone padded to one of
    ``buckets`` (the static prefill's chunk lengths, ascending). A piece that would pass the
    slot's end starts earlier instead, running again some tokens the slot already holds
    (the same K/V); ``None`` when no bucket fits the slot."""
    pieces = []
    pos = chunk.start
    while pos < chunk.end:
        need = chunk.end - pos
        bucket = min((b for b in buckets if b >= need), default=buckets[-1])
        end = min(chunk.end, pos + bucket)
        start = min(pos, slot_tokens - bucket)
        if start < 0:
            return None
        pieces.append((start, end, bucket))
        pos = end
    return pieces
