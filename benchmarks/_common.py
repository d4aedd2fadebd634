"""What the GPU benchmarks share: a stderr log, the device and a random-weight model,
environment info for the JSON, device sync, a bitsandbytes nf4 stock model, one timed round
through the decode scheduler, and matplotlib (or None)."""

from __future__ import annotations

import gc
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

GiB = 1024**3


def stderr_log(name: str) -> Callable[[str], None]:
    """A benchmark's progress log: ``[name] message`` lines on stderr (stdout is the JSON)."""

    def log(msg: str) -> None:
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)

    return log


def run_in_threads(fn: Callable[[Any], object], items: Sequence[Any]) -> float:
    """``fn(item)`` for every item, each in its own thread, all started together; the
    seconds until the last one ended."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=fn, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def pick_device(model: str | None, cpu_model: str = "random:tiny-llama") -> tuple[bool, str, str]:
    """``(gpu, device, model name)``: CUDA when there is one; the model asked for, else
    ``random:llama-2-7b`` on CUDA and ``cpu_model`` on CPU."""
    import torch

    gpu = torch.cuda.is_available()
    return gpu, "cuda" if gpu else "cpu", model or ("random:llama-2-7b" if gpu else cpu_model)


def random_model(name: str, device: str) -> Any:
    """The random-weight model ``name`` (``random:...``) on ``device``: unquantized, bf16 on
    CUDA and fp32 on CPU, SDPA attention."""
    from convo.models import Attn, DType, Quant, build_random_model, load_config

    dtype = DType.BF16 if device == "cuda" else DType.FP32
    return build_random_model(load_config(name), quant=Quant.NONE, dtype=dtype, attn=Attn.SDPA, device=device)


def env_info(device: str) -> dict[str, Any]:
    """Versions and hardware, for every benchmark's JSON."""
    import torch
    import transformers

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_GiB"] = torch.cuda.get_device_properties(0).total_memory / GiB
    else:
        env["cpus"] = os.cpu_count()
    try:
        import bitsandbytes

        env["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        pass
    return env


def replay_ms(graph: Any, reps: int = 20, calls: int = 1) -> float:
    """Median milliseconds of one replay of a captured CUDA graph, over ``calls`` calls
    it holds (the median of ``reps`` timed replays, after one untimed)."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def sync(device: str) -> None:
    """Wait for the device's queued work (timings end here)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def pyplot(log: Callable[[str], None]) -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (logged) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return None
    return plt


def to_nf4(model: Any, dtype: Any) -> None:
    """Replace every decoder linear with bitsandbytes nf4 + double quant, in place (the
    stock 4-bit baseline)."""
    import bitsandbytes as bnb
    import torch

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.named_children()):
                if type(mod) is not torch.nn.Linear:
                    continue
                new = bnb.nn.Linear4bit(
                    mod.in_features,
                    mod.out_features,
                    bias=mod.bias is not None,
                    compute_dtype=dtype,
                    compress_statistics=True,
                    quant_type="nf4",
                    device="meta",
                )
                new.weight = bnb.nn.Params4bit(
                    mod.weight.data.contiguous(),
                    requires_grad=False,
                    compress_statistics=True,
                    quant_type="nf4",
                ).to(mod.weight.device)
                if mod.bias is not None:
                    new.bias = torch.nn.Parameter(mod.bias.data, requires_grad=False)
                setattr(parent, name, new)
                del mod
    gc.collect()


def decode_round(sched: Any, reqs: Sequence[Any]) -> tuple[float, int]:
    """Submit ``reqs`` to a decode scheduler together and wait for all: the seconds from the
    last first token to the last finish, and the tokens decoded in that time."""
    for r in reqs:
        sched.submit(r)
    for r in reqs:
        r.done.wait()
        if r.error is not None:
            raise r.error
    start = max(r.first_token_at or 0.0 for r in reqs)
    end = max(r.finished_at or 0.0 for r in reqs)
    return end - start, sum(len(r.new_ids) - 1 for r in reqs)
