"""The device, as the layers that hold memory on it see it (torch is imported on use)."""

from __future__ import annotations


def empty_device_cache() -> None:
    """Return the CUDA allocator's cached, unused blocks to the device (no-op without CUDA
    or torch). The one place convo empties the cache: after an OOM and on release."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
