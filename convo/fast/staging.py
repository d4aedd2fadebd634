"""Staging a layer through a private allocator pool, so loading leaves no holes.

Quantizing a staged dense layer allocates the tensors the decoder keeps (int4 weights,
scales, biases, norms) among the dense weights and the quantizer's temporaries. In CUDA's
caching allocator they then share segments, and once the temporaries are freed those
segments stay reserved around the small tensors that live on. Measured on the H200 with
random weights (``benchmarks/fit_gpu.py``): Llama-2-7B int4 held 0.49 GiB reserved above
its 4.31 GiB allocated once the weights loaded, Qwen2.5-7B 1.12 above 5.89, and
``empty_cache`` could not return any of it.

:func:`build_staged` runs one layer's staging and quantizing with every allocation routed to
a private :class:`torch.cuda.MemPool`, copies what the layer keeps out into the default
pool (which then holds only kept tensors, packed), and releases the private pool whole.
The copies cost one int4 layer's bytes at a time. Without CUDA or ``MemPool`` it builds
in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from convo.models.device import empty_device_cache

T = TypeVar("T")


def private_pools_supported(device: Any) -> bool:
    """Whether :func:`build_staged` can route allocations on ``device`` to a private pool."""
    return (
        torch.device(device).type == "cuda"
        and hasattr(torch.cuda, "MemPool")
        and hasattr(torch.cuda, "use_mem_pool")
    )


def relocate(modules: Iterable[Any], device: Any) -> int:
    """Copy every tensor of ``modules`` on ``device`` (parameters and buffers, recursively) into
    fresh allocations, in place: a parameter keeps its identity (``param.data`` is
    replaced, so anything holding the parameter sees the copy), a buffer is replaced in
    its module. Views of one storage stay views of one copy. Returns the bytes copied."""
    device = torch.device(device)
    copies: dict[int, Any] = {}
    copied = 0

    def here(t: Any) -> bool:
        return t is not None and t.device.type == device.type and bool(t.untyped_storage().nbytes())

    def moved(t: Any) -> Any:
        nonlocal copied
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in copies:
            new = torch.empty(storage.nbytes(), dtype=torch.uint8, device=t.device)
            new.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
            copies[key] = new.untyped_storage()
            copied += storage.nbytes()
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            copies[key], t.storage_offset(), t.size(), t.stride()
        )

    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for param in module._parameters.values():
                if here(param):
                    param.data = moved(param.data)
            for name, buf in module._buffers.items():
                if here(buf):
                    module._buffers[name] = moved(buf)
    return copied


def build_staged(device: Any, build: Callable[[], T], kept: Callable[[T], Iterable[Any]]) -> T:
    """Run ``build()`` (staging a layer and quantizing it) with its allocations in a private
    pool on ``device``, then :func:`relocate` the modules ``kept(result)`` names, so
    nothing of the private pool is referenced, and release the pool.

    Every device tensor the result keeps must belong to a module ``kept`` lists (for the
    decoder: the staged layer, whose norms it reads, and the fused linears it built).

    Returns:
        What ``build()`` returned.
    """
    if not private_pools_supported(device):
        result = build()
        if torch.device(device).type == "cuda":
            empty_device_cache()  # the dense layer's blocks go back: reserved tracks the peak
        return result
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device):
        result = build()
    relocate(kept(result), device)
    torch.cuda.synchronize(device)
    del pool
    empty_device_cache()  # the private pool's segments, now unreferenced, go back
    return result
