"""``convo serve --gpu-memory CAP`` under a capped allocator, driven by the official
``openai`` client: the slots the server picks, the chat load it serves, and its measured
peak against the plan's (both read from its ``/metrics``).

``benchmarks/fit_gpu.py`` measures the same sizing through the engine in-process; this
one runs the server as users run it. The cap is the allocator fraction
(``torch.cuda.set_per_process_memory_fraction``), set in the server's process before
anything touches the GPU: a simulated 12-24 GB card (the CUDA context is not counted).

    python benchmarks/fit_serve.py --model random:benchmarks/configs/qwen2.5-7b \\
        --budget 8192 --gpu-memory 16 --kv-dtype fp8

Prints one JSON object: ``kv_slots``, ``replies``, ``errors``, ``oom``,
``peak_reserved_bytes`` (measured), ``planned_peak_reserved_bytes``, ``err`` (planned /
measured - 1; the target is 0 to +10 %) and the load's TTFT and turn times. Without
CUDA, ``--gpu-memory`` is not passed and the server runs on CPU (a check of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: The server's process: the allocator capped before convo (or anything) touches CUDA.
SERVER = """
import sys, torch
cap = float(sys.argv[1])
if cap > 0 and torch.cuda.is_available():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
from convo.cli import main
sys.exit(main(sys.argv[2:]))
"""
#: Seconds the server may take to load and warm up before the load starts.
START_TIMEOUT_S = 420.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server was not healthy after {timeout_s:.0f} s")


def scrape(base: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def user_text(session: int, turn: int, words: int) -> str:
    head = f"Session {session}, turn {turn}: tell me something new about topic {session * 31 + turn}."
    return " ".join([head, *(f"word{(session * 7 + turn * 13 + i) % 997}" for i in range(words))])


def chat(base: str, session: int, turns: int, words: int, max_tokens: int) -> dict[str, Any]:
    """One session's turns, streamed, the whole history sent each turn as OpenAI clients do."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    history: list[dict[str, str]] = []
    out: dict[str, Any] = {"ttft_s": [], "turn_s": [], "errors": []}
    for turn in range(turns):
        history.append({"role": "user", "content": user_text(session, turn, words)})
        start = time.monotonic()
        first, text = None, []
        try:
            stream = client.chat.completions.create(
                model="convo", messages=history, max_tokens=max_tokens, stream=True,  # type: ignore[arg-type]
                extra_headers={"X-Session-Id": f"fit-{session}"},
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.monotonic()
                    text.append(chunk.choices[0].delta.content)
        except Exception as exc:  # any failure is a result
            out["errors"].append(f"{type(exc).__name__}: {exc}"[:300])
            history.pop()
            continue
        end = time.monotonic()
        out["ttft_s"].append((first or end) - start)
        out["turn_s"].append(end - start)
        history.append({"role": "assistant", "content": "".join(text)})
    return out


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", default="random:tiny-llama", help="what convo serve --model loads")
    p.add_argument("--quant", default="int4")
    p.add_argument("--kv-dtype", default="auto", help="auto (the compute dtype) or fp8")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--gpu-memory", type=float, default=16.0, help="GiB: the cap and --gpu-memory")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--words", type=int, default=200, help="words per user turn")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--log", default=None, help="file for the server's log (default: a temp file)")
    args = p.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix="fit_serve_"))
    cap = args.gpu_memory * 2**30 if cuda else 0.0
    cmd = [sys.executable, "-c", SERVER, str(cap), "serve", "--model", args.model, "--port", str(port),
           "--db", str(tmp / "s.db"), "--budget", str(args.budget), "--no-memory",
           "--max-new-tokens", str(args.max_tokens), "--log-level", "info"]  # fmt: skip
    if cuda:
        cmd += ["--quant", args.quant, "--kv-dtype", args.kv_dtype, "--gpu-memory", f"{args.gpu_memory}GiB"]
    log_path = Path(args.log) if args.log else tmp / "server.log"
    result: dict[str, Any] = {"benchmark": "fit_serve", "args": vars(args), "cuda": cuda}
    with open(log_path, "w") as log:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            t0 = time.monotonic()
            wait_healthy(base, proc, START_TIMEOUT_S)
            result["start_s"] = round(time.monotonic() - t0, 1)
            before = scrape(base)
            runs: list[dict[str, Any]] = [{} for _ in range(args.sessions)]

            def one(i: int) -> None:
                runs[i] = chat(base, i, args.turns, args.words, args.max_tokens)

            t1 = time.monotonic()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(args.sessions)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            result["load_s"] = round(time.monotonic() - t1, 2)
            after = scrape(base)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"[:500]
            runs, before, after = [], {}, {}
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = log_path.read_text(errors="replace")
    picked = re.search(r"(\d+) KV slots of (\d+) tokens \((picked|asked)", text)
    errors = [e for r in runs for e in r.get("errors", [])]
    peak = after.get("convo_device_memory_peak_reserved_bytes")
    planned = after.get("convo_engine_planned_peak_reserved_bytes")
    result.update(
        kv_slots=int(picked.group(1)) if picked else None,
        replies=sum(len(r.get("turn_s", [])) for r in runs),
        expected_replies=args.sessions * args.turns,
        errors=errors[:10],
        oom="out of memory" in text.lower() or any("out of memory" in e.lower() for e in errors),
        peak_reserved_bytes=peak,
        peak_reserved_before_load_bytes=before.get("convo_device_memory_peak_reserved_bytes"),
        planned_peak_reserved_bytes=planned,
        err=round(planned / peak - 1, 4) if peak and planned else None,
        ttft_p50_s=quantile([x for r in runs for x in r.get("ttft_s", [])], 0.5),
        ttft_p95_s=quantile([x for r in runs for x in r.get("ttft_s", [])], 0.95),
        turn_p95_s=quantile([x for r in runs for x in r.get("turn_s", [])], 0.95),
        server_log_tail=text.splitlines()[-5:],
    )
    result["within_10pct_never_under"] = result["err"] is not None and 0 <= result["err"] <= 0.10
    print(json.dumps(result, indent=2))
    return 0 if not result.get("error") and not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
