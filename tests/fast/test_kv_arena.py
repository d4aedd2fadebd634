"""The host KV arena (issue 22): one buffer taken once, cut into blocks of
``HOST_BLOCK_TOKENS`` tokens of one slot's KV, handed out and taken back through a free
list. Host bytes held are exactly blocks in use times block bytes; the arena's size is what
host KV reserves; a thousand swaps allocate nothing and leave the free list full."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from convo.fast import KVSlotPool  # noqa: E402
from convo.fast.kv_host import HostKVArena  # noqa: E402
from convo.fast.kv_policy import NextUsePolicy  # noqa: E402
from convo.fast.kv_pool import HOST_BLOCK_TOKENS  # noqa: E402
from convo.fast.scheduler import DecodeScheduler  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _arena(blocks: int) -> Any:
    return HostKVArena(
        [(torch.float32, (2, 4)), (torch.float16, (2,))], block_tokens=8, blocks=blocks, pin=False
    )


def test_the_arena_fills_reuses_and_prefers_consecutive_blocks() -> None:
    arena = _arena(6)
    assert arena.block_bytes == 8 * (2 * 4 * 4 + 2 * 2) and arena.nbytes == 6 * arena.block_bytes
    assert arena.tensor.numel() == arena.nbytes and not arena.pinned
    a, b, c = arena.alloc(2), arena.alloc(2), arena.alloc(2)
    assert (a, b, c) == ([0, 1], [2, 3], [4, 5])
    assert arena.alloc(1) is None and arena.free_blocks == 0  # full: a normal answer
    arena.free(b)
    assert arena.alloc(3) is None  # only two free
    assert arena.alloc(2) == [2, 3]  # reused
    arena.free([0, 1])
    arena.free([4, 5])
    assert arena.alloc(2) == [0, 1]  # the first run of two
    got = arena.alloc(2)
    assert got == [4, 5] and arena.free_blocks == 0
    arena.free([0, 1, 4])
    assert arena.alloc(3) == [0, 1, 4]  # no run of three: the lowest ones
    with pytest.raises(ValueError, match="not in use"):
        arena.free([0, 0])
    # Runs: one copy per region per run of consecutive blocks, the last one partial.
    assert arena.runs([0, 1, 4], 20) == [(0, 2, 0, 16), (4, 1, 16, 20)]
    assert [v.shape for v in arena.run_views(0, 2, 13)] == [(13, 2, 4), (13, 2)]


def _pool(
    slots: int = 2, slot_tokens: int = 3 * HOST_BLOCK_TOKENS, dtype: Any = torch.float32, **kw: Any
) -> Any:
    return KVSlotPool(
        num_layers=2, num_kv_heads=2, head_dim=4, slots=slots, slot_tokens=slot_tokens,
        dtype=dtype, device="cpu", **kw,
    )  # fmt: skip


def _fill(pool: Any, slot: int, seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    for t in pool.slot_tensors():
        t[slot].copy_(torch.randn(t[slot].shape, generator=g).to(t.dtype))
    return [t[slot].clone() for t in pool.slot_tensors()]


def test_the_arena_is_sized_to_the_limit_in_whole_blocks_and_reported() -> None:
    pool = _pool()
    block = pool.host_block_bytes
    assert block == HOST_BLOCK_TOKENS * pool.slot_nbytes // pool.slot_tokens
    pool.set_host_memory(5 * block + block // 2)
    assert pool.host is not None and pool.host.arena.blocks == 5
    assert pool.host_reserved_bytes == 5 * block <= pool.host_limit_bytes
    stats = DecodeScheduler(_Dec(pool), background=False).stats()
    assert stats.host_reserved_bytes == 5 * block and stats.host_limit_bytes == 5 * block + block // 2
    pool.set_host_memory(block - 1)  # not one block: nothing is ever kept
    assert pool.host_reserved_bytes == 0 and pool.host is not None and not pool.host.fits(block)
    pool.set_host_memory(0)
    assert pool.host is None and pool.host_reserved_bytes == 0


class _Dec:
    def __init__(self, pool: Any) -> None:
        self.pool = pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_kv_through_scattered_blocks_comes_back_bit_for_bit(dtype: Any) -> None:
    """A fragmented free list gives an entry blocks that are not consecutive: every pool
    tensor (an fp8 pool's scales too) still comes back exactly, up to the cached tokens."""
    pool = _pool(dtype=dtype)
    pool.set_host_memory(6 * pool.host_block_bytes)
    arena = pool.host.arena  # type: ignore[union-attr]
    arena.alloc(6)
    arena.free([0, 2, 5])
    blocks = arena.alloc(3)
    assert blocks == [0, 2, 5]
    want = _fill(pool, 0, seed=1)
    tokens = 2 * HOST_BLOCK_TOKENS + 17
    assert pool.copy_out(0, tokens, blocks) is None
    _fill(pool, 1, seed=2)
    assert pool.copy_in(1, blocks, tokens) is None
    for t, w in zip(pool.slot_tensors(), want, strict=True):
        got, ref = t[1, :, :tokens].view(torch.uint8), w[:, :tokens].view(torch.uint8)
        assert torch.equal(got, ref)


def test_entries_hold_blocks_and_dropping_them_in_order_returns_them() -> None:
    clock = Clock()
    pool = _pool(slots=1, policy=NextUsePolicy(think_s=5.0), clock=clock)
    per_entry = pool.host_nbytes(150)  # two blocks
    pool.set_host_memory(2 * per_entry)
    host = pool.host
    assert host is not None

    def turn(key: str, at: float) -> None:
        clock.now = at
        got = pool.acquire(key)
        assert got is not None
        pool.release(got[0], list(range(150)))
        assert host.nbytes == host.arena.used_blocks * host.arena.block_bytes
        assert host.nbytes == sum(host.get(k).nbytes for k in host.keys())  # type: ignore[union-attr]

    turn("a", 0.0)
    turn("b", 4.0)  # a to host
    turn("c", 5.0)  # b to host: full
    assert sorted(host.keys()) == ["a", "b"] and host.arena.free_blocks == 0
    turn("d", 9.5)  # c to host: a (idle 9.5 s, expected back in 4.5 s) goes before c, b
    assert host.dropped == 1 and "a" not in host.keys() and host.arena.free_blocks == 0
    for key in ("b", "c"):
        pool.forget(key)
    assert host.arena.free_blocks == host.arena.blocks and host.nbytes == 0


def test_a_thousand_swaps_allocate_nothing_and_leave_the_free_list_full() -> None:
    clock = Clock()
    pool = _pool(slots=2, policy=NextUsePolicy(think_s=1.0), clock=clock)
    pool.set_host_memory(7 * pool.host_nbytes(HOST_BLOCK_TOKENS * 3))  # 7 of 12 sessions
    host = pool.host
    assert host is not None
    ptr, size = host.arena.tensor.data_ptr(), host.arena.tensor.numel()
    sessions = [f"s{i}" for i in range(12)]
    held: dict[str, list[int]] = {}
    for n in range(1000):
        clock.now = n * 0.1
        key = sessions[(n * 5) % len(sessions)]
        got = pool.acquire(key, ids=list(range(400)))
        assert got is not None
        slot, kept = got
        pool.ready(slot, wait=True)
        if key in held:
            assert kept == held[key][: len(kept)]
        tokens = list(range(1 + n % 380))
        pool.release(slot, tokens)
        held[key] = tokens
        assert host.nbytes == host.arena.used_blocks * host.arena.block_bytes <= host.reserved_bytes
    assert pool.swaps_out > 500 and pool.swaps_in > 100
    assert (host.arena.tensor.data_ptr(), host.arena.tensor.numel()) == (ptr, size)
    for key in sessions:
        pool.forget(key)
    assert host.arena.free_blocks == host.arena.blocks and host.nbytes == 0 and host.keys() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_arena_is_pinned_once_and_swaps_allocate_no_pinned_memory() -> None:
    """On CUDA the arena is page-locked once; 200 swaps (side-stream copies to it and
    back, bf16 and fp8 with scales) copy exactly and take nothing from PyTorch's pinned
    caching allocator (after the first swap)."""
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        pool = KVSlotPool(
            num_layers=2, num_kv_heads=2, head_dim=64, slots=2, slot_tokens=3 * HOST_BLOCK_TOKENS,
            dtype=dtype, device="cuda",
        )  # fmt: skip
        pool.set_host_memory(8 * pool.host_block_bytes)
        arena = pool.host.arena  # type: ignore[union-attr]
        assert arena.pinned and arena.tensor.is_pinned()
        for t in pool.slot_tensors():
            t[0].copy_(torch.randn(t[0].shape, device="cuda").to(dtype))
        want = [t[0].clone() for t in pool.slot_tensors()]
        tokens = 2 * HOST_BLOCK_TOKENS + 5
        # One swap first: the copies' first use may take a pinned block of PyTorch's once.
        blocks = arena.alloc(arena.blocks_for(tokens))
        pool.copy_out(0, tokens, blocks)
        pool.copy_in(1, blocks, tokens).synchronize()
        arena.free(blocks)
        stats = getattr(torch.cuda, "host_memory_stats", None)
        before = {k: stats().get(k) for k in ("allocated_bytes.current", "num_host_alloc")} if stats else {}
        for _ in range(100):
            blocks = arena.alloc(arena.blocks_for(tokens))
            assert blocks is not None
            pool.copy_out(0, tokens, blocks)
            pool.copy_in(1, blocks, tokens).synchronize()
            arena.free(blocks)
        for t, w in zip(pool.slot_tensors(), want, strict=True):
            assert torch.equal(t[1, :, :tokens].view(torch.uint8), w[:, :tokens].view(torch.uint8))
        if stats is not None:  # (rounded up to powers of two, kept: what the arena replaces)
            after = {k: stats().get(k) for k in before}
            # 100 swaps of 2 x 2 layers: the old path took pinned blocks for each. Seen on an
            # H200: one allocation of a few bytes, once, somewhere in the loop; none per swap.
            assert after["num_host_alloc"] - before["num_host_alloc"] <= 1, (before, after)
            assert after["allocated_bytes.current"] - before["allocated_bytes.current"] < 1 << 20
