"""A model of CUDA's caching allocator packing tensors that are never freed.

Weights loaded once stay allocated for the process's life, so the bytes the allocator
reserves for them are fixed by the order and sizes of their allocations: small blocks are
carved from 2 MiB segments, medium ones from 20 MiB segments, large ones take a segment of
their own rounded to 2 MiB, and each request takes the smallest free block that holds it.
The rules are PyTorch's ``CUDACachingAllocator`` (``c10/cuda/CUDACachingAllocator.cpp``,
defaults: no ``max_split_size_mb``, no expandable segments).

With the static decoder's int4 layers staged through a private pool
(:mod:`convo.fast.staging`), the default pool sees only the tensors kept, in loading order,
and this model predicts its reserved bytes. Measured on an H200 (random weights, int4
group 32, one layout, ``benchmarks/results/fit_gpu_h200_s11.json``), with the decoder's
rotary tables and the cuBLAS workspace (32 MiB, a segment of its own) appended
(:meth:`convo.planner.memory.VRAMModel.weights_reserved_bytes`): Qwen2.5-7B priced to the
byte, Llama-2-7B 2 MiB over (4.402 against 4.400 GiB).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

MiB = 1 << 20
#: Every block is rounded up to this many bytes (``kMinBlockSize``).
BLOCK_ROUND_BYTES = 512
#: Requests up to this size come from the small pool (``kSmallSize``).
SMALL_REQUEST_BYTES = 1 * MiB
#: A small-pool segment (``kSmallBuffer``).
SMALL_SEGMENT_BYTES = 2 * MiB
#: Requests below this size get a :data:`MEDIUM_SEGMENT_BYTES` segment (``kMinLargeAlloc``).
MEDIUM_REQUEST_BYTES = 10 * MiB
#: A segment for a medium request (``kLargeBuffer``), later split for others.
MEDIUM_SEGMENT_BYTES = 20 * MiB
#: Larger requests take a segment of their own, rounded up to this (``kRoundLarge``).
LARGE_ROUND_BYTES = 2 * MiB


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def segment_bytes(nbytes: int) -> int:
    """The segment the allocator reserves for a request of ``nbytes`` it cannot place."""
    n = _round(nbytes, BLOCK_ROUND_BYTES)
    if n <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if n < MEDIUM_REQUEST_BYTES:
        return MEDIUM_SEGMENT_BYTES
    return _round(n, LARGE_ROUND_BYTES)


def reserved_bytes(sizes: Iterable[int]) -> int:
    """Bytes the caching allocator reserves for allocations of ``sizes`` (in order, none
    freed, on one stream, starting from an empty pool).

    Each request takes the smallest free block that holds it (best fit), splitting off
    the rest when that rest is at least a block (small pool) or more than
    :data:`SMALL_REQUEST_BYTES` (large pool); with no such block a new segment is reserved
    (:func:`segment_bytes`). Zero-byte requests take nothing.

    >>> reserved_bytes([3 * MiB, 5 * MiB]) // MiB  # one 20 MiB segment holds both
    20
    >>> reserved_bytes([11 * MiB]) // MiB  # a segment of its own, rounded to 2 MiB
    12
    """
    free: dict[bool, list[int]] = {True: [], False: []}  # small pool? -> free block sizes, sorted
    total = 0
    for size in sizes:
        if size <= 0:
            continue
        n = _round(int(size), BLOCK_ROUND_BYTES)
        small = n <= SMALL_REQUEST_BYTES
        blocks = free[small]
        i = bisect.bisect_left(blocks, n)
        if i < len(blocks):
            block = blocks.pop(i)
        else:
            block = segment_bytes(n)
            total += block
        rest = block - n
        if (rest >= BLOCK_ROUND_BYTES) if small else (rest > SMALL_REQUEST_BYTES):
            bisect.insort(blocks, rest)
    return total
