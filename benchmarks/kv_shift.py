"""Context shift against a recomputed prompt: how much a reply changes on real weights (CPU).

A context shift (:mod:`convo.fast.kv_shift`) reuses a session's kept turns after its window
slid: their K/V move to their new positions and the keys are turned, instead of being
prefilled again. It is not exact: the kept turns' K/V were computed while they attended to
the turns that were dropped and to the old summary. This measures what that costs on the
embedded SmolLM2-135M-Instruct (float32, the static decoder's eager path on CPU), on real
dialogue: LoCoMo conversations (``--data``, read in place, never copied).

For each slide: the slot holds ``[system + summary 1][turns lo..hi]`` (the cached turn and
its reply); the next prompt is ``[system + summary 2][turns lo + drop..hi][user turn]`` and
the reference reply (the conversation's next message) is read teacher-forced. At every
token after the kept run (the user turn and the reply) we compare the next-token
distribution of

* the shifted cache against the prompt recomputed from scratch (``shift``), and
* for scale, the recomputed prompt with fp8 K/V, which convo ships as a small accuracy
  cost (``fp8``; ``benchmarks/kv_fp8.py``),

as top-1 agreement, mean KL(recomputed || other) in nats, and the reply's perplexity. Then
each answers the prompt freely (greedy, up to ``--reply-tokens``): how many replies are
identical to the recomputed prompt's, and where the others first differ.
The "summary" is a stand-in (the first words of each dropped message): what matters is
that it changes and shifts the kept turns.

``--memory N`` adds what a session with retrieval memory shows: after the user turn, a
memory message with the last ``N`` dropped messages as ``speaker: text`` lines. The slot
still holds those messages, so a context shift moves them too: ``shift`` is what the
scheduler moves (:func:`~convo.fast.kv_shift.find_shifts`: every run, the first
:data:`~convo.fast.kv_shift.SHIFT_AFTER_HEAD_TOKENS` tokens of each passage after the
question prefilled), ``shift_all`` every run whole, ``shift_kept`` the runs up to the kept
turns only (the default before 2026-12-07), ``shift_one`` only the longest (the kept
turns).

``--ordinary`` (with ``--memory N``) measures the turn after, where nothing slides: the
slot holds the previous turn, its question followed by memory ``A`` (the last ``N`` dropped
messages) and its reply; the prompt shows that reply after the question, then a new
question and memory ``B`` (the ``N`` dropped messages before the last, so all but one of
them are ``A``'s, one place later). The common prefix ends at the old question; the reply
and ``B``'s passages are runs the slot holds elsewhere. ``shift_forward`` prefills the
first :data:`~convo.fast.kv_shift.SHIFT_AFTER_HEAD_TOKENS` tokens of every run that moves
towards the end of the prompt (the passages: new context lies in front of them), the
longest included; ``shift_before`` what the scheduler moved before 2026-12-08 (whichever
way the longest run moves; ``shift`` now moves nothing unless it moves towards the start,
and the other modes keep the old rule).

``--trim-heads K[,K...]`` adds ``shift_all_trimK`` modes: as ``shift``, with the first
``K`` tokens of each run after the question prefilled.

``--provisional`` makes the new summary what a session shows while the model's is late:
``convo.summarize.provisional_summary`` of the dropped messages (their heads and tails,
at least 64 tokens a message, within 256 tokens), whose pieces the slot holds too.

    python benchmarks/kv_shift.py --conversations 6 --sessions 4 --out benchmarks/results  # ~11 min, 2 cores
    python benchmarks/kv_shift.py --conversations 6 --sessions 4 --memory 3 --out benchmarks/results

Prints one JSON object (and writes ``kv_shift_cpu.json`` under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import env_info, stderr_log
from kv_fp8 import load_default_model

from convo.fast import DecoderConfig, StaticDecoder
from convo.fast.kv_shift import (
    SHIFT_AFTER_HEAD_TOKENS,
    SHIFT_EXTRA_MIN_TOKENS,
    KVShift,
    find_shifts,
    shifted_tokens,
)
from convo.messages import Message, Role
from convo.summarize import provisional_summary
from convo.tokens import HFTokenCounter, common_prefix_length

log = stderr_log("kv_shift")
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "locomo" / "locomo-dev.json"


def dialogue(conv: dict[str, Any], sessions: int) -> tuple[str, str, list[dict[str, str]]]:
    """The first ``sessions`` sessions of a LoCoMo conversation as chat messages: speaker A
    is the user, speaker B the assistant (a speaker's consecutive lines joined)."""
    c = conv["conversation"]
    a, b = c["speaker_a"], c["speaker_b"]
    msgs: list[dict[str, str]] = []
    for n in range(1, sessions + 1):
        for line in c.get(f"session_{n}", []):
            role = "user" if line["speaker"] == a else "assistant"
            if msgs and msgs[-1]["role"] == role:
                msgs[-1]["content"] += " " + line["text"]
            else:
                msgs.append({"role": role, "content": line["text"]})
    if msgs and msgs[0]["role"] == "assistant":
        msgs = msgs[1:]
    return a, b, msgs


def summary(system: str, dropped: list[dict[str, str]]) -> str:
    """The system message with a stand-in summary: the first words of the last dropped messages."""
    gist = [" ".join(m["content"].split()[:12]) for m in dropped[-8:]]
    return f"{system}\nEarlier in this chat: " + " / ".join(gist)


def render(tokenizer: Any, messages: list[dict[str, str]], *, generation: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def decoder(model: Any, kv: str, slot_tokens: int) -> StaticDecoder:
    dec = StaticDecoder(
        model,
        slots=1,
        slot_tokens=slot_tokens,
        kv_dtype=kv,
        config=DecoderConfig(prefill_chunk_tokens=512),
    )
    dec.warmup()
    return dec


def compare(ref: Any, other: Any) -> tuple[int, float]:
    """Top-1 agreements and summed KL(ref || other) over the rows of two logit matrices."""
    import torch

    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(other.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return int((ref.argmax(-1) == other.argmax(-1)).sum()), float(kl.sum())


def nll(logits: Any, ids: list[int]) -> float:
    """Summed next-token loss of ``ids`` under ``logits`` (row i predicts ids[i])."""
    import torch
    import torch.nn.functional as F

    return float(F.cross_entropy(logits.float(), torch.tensor(ids), reduction="sum"))


def memory_message(dropped: list[dict[str, str]], a: str, b: str) -> dict[str, str]:
    """The memory message a session shows after its question: dropped messages as lines."""
    lines = [f"{a if m['role'] == 'user' else b}: {m['content']}" for m in dropped]
    return {"role": "system", "content": "Relevant memory:\n" + "\n".join(lines)}


def shifted_prefill(dec: StaticDecoder, cached: list[int], ids: list[int], common: int, runs: Any) -> Any:
    """Slot 0 holds ``cached``; move ``runs`` and prefill around them up to the end of
    ``ids``: the logits of the tokens after the last run (the last prefill's)."""
    dec.prefill(0, cached, 0)
    if runs:
        dec.pool.shift(0, runs)
    at = common
    for r in runs:
        if r.dst > at:
            dec.prefill(0, ids[: r.dst], at)
        at = r.dst + r.length
    return dec.prefill(0, ids, at, all_logits=True)[0], at


def greedy(dec: StaticDecoder, logits: Any, position: int, n: int, eos: int) -> list[int]:
    """Up to ``n`` greedy tokens in slot 0 from ``logits`` (after the token at ``position - 1``)."""
    out: list[int] = []
    for i in range(n):
        token = int(logits.argmax())
        out.append(token)
        if token == eos or i == n - 1:
            break
        logits = dec.step([token], [0], [position + i])[0]
    return out


def heads_forward(runs: Any, head: int) -> tuple[KVShift, ...]:
    """``runs`` with the first ``head`` tokens of each run that moves towards the end of the
    prompt left to prefill (a run with fewer than ``SHIFT_EXTRA_MIN_TOKENS`` left is dropped)."""
    out = []
    for r in runs:
        if r.delta > 0:
            if r.length - head < SHIFT_EXTRA_MIN_TOKENS:
                continue
            r = KVShift(src=r.src + head, dst=r.dst + head, length=r.length - head)
        out.append(r)
    return tuple(out)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two replies differ (``None``: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="LoCoMo JSON (read in place)")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--sessions", type=int, default=3, help="sessions of each conversation to chat through")
    p.add_argument("--window", type=int, default=24, help="messages the window holds before a slide")
    p.add_argument("--drop", type=int, default=8, help="messages a slide drops")
    p.add_argument("--stride", type=int, default=8, help="messages between two measured slides")
    p.add_argument("--slot-tokens", type=int, default=2048)
    p.add_argument("--reply-tokens", type=int, default=48, help="greedy reply tokens compared per slide")
    p.add_argument("--memory", type=int, default=0, help="dropped messages shown after the question")
    p.add_argument("--provisional", action="store_true", help="the new summary: a provisional one")
    p.add_argument("--ordinary", action="store_true", help="with --memory: the turn after, no slide")
    p.add_argument(
        "--trim-heads",
        default="",
        help="comma-separated K: with --memory, also move every run, prefilling the first K tokens "
        "of each run after the question",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch

    torch.manual_seed(0)
    started = time.monotonic()
    model, tok = load_default_model(torch.float32)
    dec = decoder(model, "auto", args.slot_tokens)
    dec8 = decoder(model, "fp8", args.slot_tokens)
    convs = json.loads(args.data.read_text())[: args.conversations]
    several = args.memory or args.provisional
    kinds = ("shift", "shift_one", "fp8") if several else ("shift", "fp8")
    kinds = ("shift_all", "shift_kept", *kinds) if args.memory else kinds
    kinds = ("shift_before", "shift_forward", *kinds) if args.ordinary else kinds
    trims = [int(k) for k in args.trim_heads.split(",") if k.strip()] if args.memory else []
    kinds = (*kinds, *(f"shift_all_trim{k}" for k in trims))
    counter = HFTokenCounter(tok)
    totals = {k: {"agree": 0, "kl": 0.0, "nll": 0.0} for k in kinds}
    reference_nll, tokens, slides, moved, skipped = 0.0, 0, [], 0, 0
    eos = int(tok.convert_tokens_to_ids("<|im_end|>"))
    free: dict[str, list[int | None]] = {k: [] for k in kinds}  # first divergence per slide
    moved_by: dict[str, int] = {k: 0 for k in kinds if k != "fp8"}  # tokens each mode moved
    with torch.no_grad():
        for conv in convs:
            a, b, msgs = dialogue(conv, args.sessions)
            system = f"You are {b}, chatting with your friend {a}."
            for hi in range(args.window + 1, len(msgs) - 2, args.stride):
                lo1, lo2 = hi - args.window, hi - args.window + args.drop
                if msgs[hi - 1]["role"] != "assistant":  # the cached turn ends with a reply
                    hi -= 1
                    lo1, lo2 = lo1 - 1, lo2 - 1
                if lo1 < 0:
                    continue

                before = {"role": "system", "content": summary(system, msgs[:lo1])}
                cached = render(tok, [before, *msgs[lo1:hi]])
                now = {"role": "system", "content": summary(system, msgs[:lo2])}
                if args.ordinary:  # the previous turn: the window up to its question, memory A, the reply
                    dropped = msgs[:lo2]
                    if len(dropped) <= args.memory:
                        skipped += 1
                        continue
                    mem_a = memory_message(dropped[-args.memory :], a, b)
                    mem_b = memory_message(dropped[-args.memory - 1 : -1], a, b)
                    prev = render(tok, [now, *msgs[lo2 : hi - 1], mem_a], generation=True)
                    said = msgs[hi - 1]["content"] + "<|im_end|>"
                    cached = prev + list(tok(said, add_special_tokens=False)["input_ids"])
                if args.provisional:  # the old summary, then excerpts of what the new one misses
                    dropped = [Message(role=Role(m["role"]), content=m["content"]) for m in msgs[lo1:lo2]]
                    text = provisional_summary(
                        previous=summary("", msgs[:lo1]), messages=dropped, counter=counter, max_tokens=256
                    )
                    now = {"role": "system", "content": f"{system}\n{text}"}
                memory = [memory_message(msgs[lo1:lo2][-args.memory :], a, b)] if args.memory else []
                if args.ordinary:
                    memory = [mem_b]
                head = render(tok, [now, *msgs[lo2:hi], msgs[hi], *memory], generation=True)
                reply = msgs[hi + 1]["content"] + "<|im_end|>"
                reply_ids = list(tok(reply, add_special_tokens=False)["input_ids"])
                ids = head + reply_ids
                if max(len(cached), len(ids)) > args.slot_tokens:
                    skipped += 1
                    continue
                common = common_prefix_length(cached, ids)
                runs = find_shifts(cached, ids, start=common, limit=len(head) - 1)

                # the other modes: runs moved whichever way the longest moves
                old_rule = partial(
                    find_shifts, cached, ids, start=common, limit=len(head) - 1, toward_start=False
                )
                every = old_rule(after_head_tokens=0)
                if not every:
                    skipped += 1
                    continue
                longest = max(every, key=lambda r: r.length)
                modes: dict[str, tuple[KVShift, ...]] = {"shift": runs}
                if args.ordinary:
                    modes["shift_before"] = old_rule()
                    modes["shift_forward"] = heads_forward(every, SHIFT_AFTER_HEAD_TOKENS)
                if several:
                    modes["shift_one"] = (longest,)
                if args.memory:
                    modes["shift_all"] = every
                    modes["shift_kept"] = old_rule(after_head_tokens=None)
                for k in trims:
                    modes[f"shift_all_trim{k}"] = old_rule(after_head_tokens=k)
                # Compared from the token after the last run of every mode on: the rows
                # before it are the prompt's, prefilled or moved.
                after = max(r.dst + r.length for r in every)
                # Recomputed from scratch, then fp8 K/V: logits of every token.
                ref, _ = dec.prefill(0, ids, 0, all_logits=True)
                ref8, _ = dec8.prefill(0, ids, 0, all_logits=True)
                rows = slice(after, len(ids) - 1)
                targets = ids[after + 1 :]
                base = ref[rows]
                cmp = {"fp8": ref8[rows]}
                for mode, moved_runs in modes.items():
                    # The shifted prefill's rows start at its last run's end; the row that
                    # predicts ``after`` itself is a run's last token (no logits): from
                    # after + 1 on.
                    logits, at = shifted_prefill(dec, cached, ids, common, moved_runs)
                    cmp[mode] = logits[after - at : -1]
                reference_nll += nll(base, targets)
                tokens += len(targets)
                for k, logits in cmp.items():
                    agree, kl = compare(base, logits)
                    totals[k]["agree"] += agree
                    totals[k]["kl"] += kl
                    totals[k]["nll"] += nll(logits, targets)
                # Free-running greedy replies to the prompt (no reference reply): recomputed,
                # fp8, shifted; the first token where each differs from the recomputed one.
                last, _ = dec.prefill(0, head, 0)
                ref_reply = greedy(dec, last, len(head), args.reply_tokens, eos)
                last, _ = dec8.prefill(0, head, 0)
                free["fp8"].append(
                    first_divergence(ref_reply, greedy(dec8, last, len(head), args.reply_tokens, eos))
                )
                for mode, moved_runs in modes.items():
                    logits, _ = shifted_prefill(dec, cached, head, common, moved_runs)
                    reply_ids_free = greedy(dec, logits[-1], len(head), args.reply_tokens, eos)
                    free[mode].append(first_divergence(ref_reply, reply_ids_free))
                moved += shifted_tokens(runs)
                for mode, moved_runs in modes.items():
                    moved_by[mode] += shifted_tokens(moved_runs)
                slides.append(
                    {
                        "cached": len(cached),
                        "prompt": len(ids),
                        "common": common,
                        "moved": shifted_tokens(runs),
                        "runs": len(runs),
                        "delta": longest.delta,
                        "compared": len(targets),
                    }
                )
                log(
                    f"slide {len(slides)}: moved {shifted_tokens(runs)} in {len(runs)} runs, "
                    f"compared {len(targets)}"
                )
    results: dict[str, Any] = {
        "slides": len(slides),
        "skipped": skipped,
        "compared_tokens": tokens,
        "moved_tokens": moved,
        "prefill_saved": round(moved / sum(s["prompt"] for s in slides), 3) if slides else None,
        "reference_perplexity": round(math.exp(reference_nll / tokens), 3) if tokens else None,
    }
    for k, t in totals.items():
        results[k] = {
            "top1_agreement": round(t["agree"] / tokens, 4) if tokens else None,
            "mean_kl_nats": round(t["kl"] / tokens, 5) if tokens else None,
            "perplexity": round(math.exp(t["nll"] / tokens), 3) if tokens else None,
        }
    for k, n in moved_by.items():
        results[k]["moved_tokens"] = n
    for k, divergences in free.items():
        differ = [d for d in divergences if d is not None]
        results[k]["identical_replies"] = len(divergences) - len(differ)
        results[k]["first_divergence_median"] = statistics.median(differ) if differ else None
    results["replies_compared"] = len(slides)
    results["delta_median"] = statistics.median(s["delta"] for s in slides) if slides else None
    report = {
        "benchmark": "kv_shift",
        "device": "cpu",
        "env": env_info("cpu"),
        "config": {k: str(v) for k, v in vars(args).items()},
        "results": results,
        "slides": slides,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_shift_cpu.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
