"""fp8 (e4m3) KV slots against K/V in the model's dtype: accuracy on real weights (CPU) and
speed on the GPU (``--cuda``).

Accuracy (default; the embedded SmolLM2-135M-Instruct on CPU, the static decoder's eager
path: fp8 is stored in the pool and dequantized for SDPA, the same values the CUDA kernels
read):

* **perplexity** of a fixed text: the first ``--tokens`` tokens (3,072) of the repository's
  ``README.md`` (or ``--text``), its sha256 in the JSON. One prefill with the logits of every
  token, chunks of 512: every attention input comes back out of the pool (fp8: quantized,
  then dequantized). For the model in float32 (``kv fp32`` vs ``fp8``; ``--dtypes
  fp32,bf16`` adds the model cast to bf16, ``kv bf16`` vs ``fp8``), and ``fp8-unscaled``
  (benchmark-only: e4m3 without scales, the scale of 1.0 that an uncalibrated per-tensor
  scheme uses), to show what the per-token and head scales buy.
* **greedy token agreement** over a scripted multi-turn chat (``examples/demo_turns.txt``,
  then three more turns, up to ``--reply-tokens`` per reply): the reference (model-dtype
  K/V) chats greedily; fp8 then reads the same transcript, and at every reply token we ask
  whether its greedy choice is the reference's (teacher-forced agreement); and it chats
  freely too (identical replies, first divergence per turn).

Speed (``--cuda``, on the GPU; ``random:llama-2-7b`` int4 by default): decode steps at 1 and
16 rows (slots holding ``--contexts`` tokens each), and a ``--prefill-tokens`` prefill, with
bf16 K/V and fp8 K/V, captured graphs on both; the pools' measured and predicted bytes;
dynamo graphs and captures after warm-up (0 new). Target: decode within 5 % of bf16 KV,
prefill unchanged.

    python benchmarks/kv_fp8.py                     # CPU accuracy, ~15 min on 2 idle cores
    python benchmarks/kv_fp8.py --cuda --out benchmarks/results

Prints one JSON object (and writes ``kv_fp8_<cpu|cuda>.json`` under ``--out``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import env_info, random_model, stderr_log, sync

import convo.fast.attention as kernels
from convo.fast import DecoderConfig, StaticDecoder
from convo.models.defaults import FP8_KV_SCALE_BYTES, FP8_KV_SCALE_DTYPE

log = stderr_log("kv_fp8")
ROOT = Path(__file__).resolve().parents[1]

#: Turns after ``examples/demo_turns.txt``: a longer chat, and questions whose answers sit
#: early in it (what a KV error would lose first).
MORE_TURNS = (
    "Write three short tips for packing light.",
    "Remind me what drink I love, and what I like to do by the sea.",
    "Summarize our conversation in two sentences.",
)


# -- accuracy (CPU) --------------------------------------------------------------------------------


def load_default_model(dtype: Any) -> tuple[Any, Any]:
    """The embedded SmolLM2-135M-Instruct in ``dtype`` and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from convo.engines.local.loading import default_model_path

    path = str(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(path, local_files_only=True)


@contextmanager
def unscaled_fp8() -> Iterator[None]:
    """fp8 writes without scales (every scale 1.0) while the block runs: the benchmark's
    stand-in for an uncalibrated per-tensor scale."""
    import torch

    real = kernels.quantize_kv

    def plain(x: Any) -> tuple[Any, Any]:
        m = kernels.FP8_E4M3_MAX
        ones = x.new_ones(x.shape[:-1], dtype=getattr(torch, FP8_KV_SCALE_DTYPE))  # the pool's scale dtype
        return x.float().clamp(-m, m).to(torch.float8_e4m3fn), ones

    kernels.quantize_kv = plain
    try:
        yield
    finally:
        kernels.quantize_kv = real


def decoder(model: Any, kv: str, slot_tokens: int) -> StaticDecoder:
    """A one-slot static decoder over ``model`` with K/V stored as ``kv`` (fp8-unscaled: fp8)."""
    dec = StaticDecoder(
        model,
        slots=1,
        slot_tokens=slot_tokens,
        kv_dtype="fp8" if kv.startswith("fp8") else "auto",
        config=DecoderConfig(prefill_chunk_tokens=512),
    )
    dec.warmup()
    return dec


def perplexity(dec: StaticDecoder, ids: list[int]) -> float:
    """``exp`` of the mean next-token loss of ``ids`` (one prefill, logits of every token)."""
    import torch
    import torch.nn.functional as F

    logits, _ = dec.prefill(0, ids, 0, all_logits=True)
    loss = F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(float(loss))


def chat(dec: StaticDecoder, tokenizer: Any, turns: list[str], reply_tokens: int) -> list[list[int]]:
    """Greedy replies to ``turns``, one after the other in one slot (each turn prefills
    what the slot does not hold yet); returns each reply's token ids."""
    eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    messages: list[dict[str, str]] = []
    held: list[int] = []
    replies = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = _render(tokenizer, messages)
        start = _common_prefix(held, ids)
        start = min(start, len(ids) - 1)
        logits, _ = dec.prefill(0, ids, start)
        reply: list[int] = []
        while True:
            token = int(logits.argmax())
            reply.append(token)
            if token in eos or len(reply) >= reply_tokens:
                break
            logits = dec.step([token], [0], [len(ids) + len(reply) - 1])[0]
        held = ids + reply[:-1]  # the slot holds K/V of every token but the last one picked
        replies.append(reply)
        messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
    return replies


def teacher_forced_agreement(
    dec: StaticDecoder, tokenizer: Any, turns: list[str], replies: list[list[int]]
) -> tuple[int, int]:
    """``(agreeing, total)``: over every reply token of the reference chat, whether ``dec``'s
    greedy pick, reading the reference transcript up to it, is that token."""
    messages: list[dict[str, str]] = []
    same = total = 0
    for turn, reply in zip(turns, replies, strict=True):
        messages.append({"role": "user", "content": turn})
        prompt = _render(tokenizer, messages)
        ids = prompt + reply
        logits, _ = dec.prefill(0, ids, 0, all_logits=True)
        picks = logits[len(prompt) - 1 : len(ids) - 1].argmax(-1).tolist()
        same += sum(int(a == b) for a, b in zip(picks, reply, strict=True))
        total += len(reply)
        messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
    return same, total


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's token ids for ``messages``, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    text_path = Path(args.text)
    text = text_path.read_text(encoding="utf-8")
    turns = [t for t in (ROOT / "examples" / "demo_turns.txt").read_text().splitlines() if t.strip()]
    turns += list(MORE_TURNS)
    results: dict[str, Any] = {
        "text": {
            "path": str(text_path.relative_to(ROOT) if text_path.is_relative_to(ROOT) else text_path),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "tokens": args.tokens,
        },
        "chat_turns": len(turns),
        "reply_tokens": args.reply_tokens,
        "models": {},
    }
    for dtype_name in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        model, tokenizer = load_default_model(dtype)
        ids = tokenizer(text)["input_ids"][: args.tokens]
        if len(ids) < args.tokens:
            raise SystemExit(f"{text_path} has only {len(ids)} tokens; --tokens {args.tokens}")
        row: dict[str, Any] = {"perplexity": {}, "pool_bytes_per_token": {}}
        slot = max(args.tokens, 2048)
        for kv in (dtype_name, "fp8", "fp8-unscaled"):
            with unscaled_fp8() if kv == "fp8-unscaled" else _nothing():
                dec = decoder(model, kv, slot)
                t0 = time.perf_counter()
                row["perplexity"][kv] = perplexity(dec, ids)
                row["pool_bytes_per_token"][kv] = dec.pool.nbytes // dec.pool.slot_tokens
                took = time.perf_counter() - t0
                log(f"{dtype_name} model, {kv} KV: ppl {row['perplexity'][kv]:.4f} ({took:.0f} s)")
                if kv == dtype_name:
                    reference = chat(dec, tokenizer, turns, args.reply_tokens)
                    log(f"{dtype_name} model, {kv} KV: reference chat of {sum(map(len, reference))} tokens")
                    continue
                forced = teacher_forced_agreement(dec, tokenizer, turns, reference)
                free = chat(dec, tokenizer, turns, args.reply_tokens)
                first_diff = [
                    _common_prefix(a, b) if a != b else None for a, b in zip(reference, free, strict=True)
                ]
                row[kv] = {
                    "teacher_forced_agreement": _ratio(*forced),
                    "agreeing_tokens": forced[0],
                    "reply_tokens": forced[1],
                    "identical_replies": sum(d is None for d in first_diff),
                    "first_divergence_per_turn": first_diff,
                }
                log(f"{dtype_name} model, {kv} KV: agreement {row[kv]['teacher_forced_agreement']:.4f}")
            del dec
        base = row["perplexity"][dtype_name]
        row["perplexity_delta"] = {k: v - base for k, v in row["perplexity"].items() if k != dtype_name}
        results["models"][dtype_name] = row
    return results


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _ratio(a: int, b: int) -> float:
    return a / b if b else float("nan")


# -- speed (CUDA) ----------------------------------------------------------------------------------


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def speed(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import counters

    from convo.planner import VRAMModel

    torch.manual_seed(0)
    model = random_model(args.model, "cuda")
    rows_list = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    slots = max(rows_list)
    out: dict[str, Any] = {"model": args.model, "weights": args.weights, "slots": slots, "kv": {}}
    for kv in ("auto", "fp8"):
        dec = StaticDecoder(
            model,
            slots=slots,
            slot_tokens=args.slot_tokens,
            kv_dtype=kv,
            weights=args.weights,
            config=DecoderConfig(group_size=args.group_size),
        )
        name = "bf16" if kv == "auto" else "fp8"
        log(f"{name}: warm-up (compile and capture)")
        dec.warmup()
        graphs, captures = counters["stats"]["unique_graphs"], dec.captures
        mm = VRAMModel.from_model(args.model, quant="int4", kv_dtype="fp8" if kv == "fp8" else None)
        row: dict[str, Any] = {
            "pool_bytes_measured": dec.pool_measured_bytes,
            "pool_bytes_predicted": dec.pool_predicted_bytes,
            "pool_bytes_planner": mm.kv_pool_bytes(slots, args.slot_tokens),
            "decode_ms": {},
            "decode_tok_s": {},
        }
        ids = torch.randint(1, 32000, (args.slot_tokens,)).tolist()
        for ctx in contexts:
            for s in range(slots):
                dec.prefill(s, ids[:ctx], 0)
            for rows in rows_list:
                tokens, which, positions = ids[:rows], list(range(rows)), [ctx] * rows
                ms = _median_ms(functools.partial(dec.step, tokens, which, positions), args.reps)
                row["decode_ms"][f"{rows}x{ctx}"] = ms
                row["decode_tok_s"][f"{rows}x{ctx}"] = rows / ms * 1e3
                log(f"{name}: decode {rows} rows at {ctx} tokens: {ms:.3f} ms")
        n = args.prefill_tokens
        ms = _median_ms(functools.partial(dec.prefill, 0, ids[:n], 0), max(3, args.reps // 10))
        row["prefill_ms"] = ms
        row["prefill_tok_s"] = n / ms * 1e3
        log(f"{name}: prefill {n} tokens: {ms:.1f} ms")
        row["new_dynamo_graphs_after_warmup"] = counters["stats"]["unique_graphs"] - graphs
        row["new_captures_after_warmup"] = dec.captures - captures
        out["kv"][name] = row
        del dec
        torch.cuda.empty_cache()
    bf16, fp8 = out["kv"]["bf16"], out["kv"]["fp8"]
    out["fp8_vs_bf16"] = {
        "decode_time_ratio": {k: fp8["decode_ms"][k] / v for k, v in bf16["decode_ms"].items()},
        "prefill_time_ratio": fp8["prefill_ms"] / bf16["prefill_ms"],
        "pool_bytes_ratio": fp8["pool_bytes_measured"] / bf16["pool_bytes_measured"],
        "scale_bytes_per_head_vector": FP8_KV_SCALE_BYTES,
    }
    out["targets"] = {
        "decode_within_5_percent": all(r <= 1.05 for r in out["fp8_vs_bf16"]["decode_time_ratio"].values()),
        "prefill_unchanged_within_5_percent": out["fp8_vs_bf16"]["prefill_time_ratio"] <= 1.05,
        "pool_exact": all(
            r["pool_bytes_measured"] == r["pool_bytes_predicted"] == r["pool_bytes_planner"]
            for r in out["kv"].values()
        ),
        "no_recompiles": all(
            r["new_dynamo_graphs_after_warmup"] == 0 and r["new_captures_after_warmup"] == 0
            for r in out["kv"].values()
        ),
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", action="store_true", help="time decode and prefill on the GPU")
    p.add_argument("--text", default=str(ROOT / "README.md"), help="the perplexity text (default README.md)")
    p.add_argument("--tokens", type=int, default=3072, help="tokens of the text to score")
    p.add_argument("--dtypes", default="fp32", help="model dtypes for the accuracy runs (fp32,bf16)")
    p.add_argument("--reply-tokens", type=int, default=64, help="most tokens of one chat reply")
    p.add_argument("--model", default="random:llama-2-7b", help="--cuda: the architecture (random weights)")
    p.add_argument("--weights", default="int4", choices=["int4", "as-loaded"], help="--cuda: int4 or bf16")
    p.add_argument("--group-size", type=int, default=32, help="--cuda: int4 group size (the engine's)")
    p.add_argument("--rows", default="1,16", help="--cuda: decode rows")
    p.add_argument("--contexts", default="512,1900", help="--cuda: tokens each row's slot holds")
    p.add_argument("--slot-tokens", type=int, default=2048, help="--cuda: tokens per slot")
    p.add_argument("--prefill-tokens", type=int, default=2000, help="--cuda: prompt tokens to prefill")
    p.add_argument("--reps", type=int, default=50, help="--cuda: timed repetitions (median)")
    p.add_argument("--out", default=None, help="folder for kv_fp8_<cpu|cuda>.json")
    args = p.parse_args()
    device = "cuda" if args.cuda else "cpu"
    result = {"benchmark": "kv_fp8", "device": device, "env": env_info(device)}
    result.update(speed(args) if args.cuda else accuracy(args))
    sync(device)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"kv_fp8_{device}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
