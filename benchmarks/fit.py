"""convo.fit against LangChain's trim_messages on agent histories with tool calls.

Histories of 100, 1k and 10k OpenAI messages: a system prompt, then turns of a user
question, 0-3 tool steps (an assistant tool call with 1-2 JSON tool results) and an
answer. Each trimmer fits every history into the same prompt budget
(``--context-tokens`` minus ``--max-new-tokens``), each with its default counter:

* ``convo.fit``: the model's own counter (``HFTokenCounter``: SmolLM2's tokenizer with a
  ChatML template that renders tool calls, Qwen2.5 style), checked on the rendered prompt.
* ``trim_messages``: ``token_counter="approximate"`` (``count_tokens_approximately``),
  ``strategy="last"``, ``include_system=True``, ``start_on="human"``, as LangChain's docs
  recommend for chat models.

The truth for both is the length of the prompt rendered through that template (generation
prompt included). Reported per size: time per call (median over repeats; convo's first
call on a history is "cold": every message counted once, later calls hit the count
cache, as in an agent loop that calls fit before each model call), budget violations
(outputs whose rendered prompt exceeds the budget), split tool blocks (a call without all
its results, or a result without its call), and how much of the budget the output used.
Times for trim_messages exclude converting the dicts to LangChain messages.

    python benchmarks/fit.py --json > benchmarks/results/fit_cpu.json

Prints one JSON object (hardware, versions, results) and writes ``--png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from importlib import metadata
from typing import Any

#: ChatML that renders assistant tool calls and tool results (as Qwen2.5's template does).
TOOL_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + call['function']['arguments'] + '}\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = (
    "the flight to lisbon leaves at nine and the hotel near the river has a view of the bridge "
    "please check the weather forecast and book a table for two at a quiet restaurant"
).split()


def text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def tool_result(rng: random.Random) -> str:
    rows = [
        {
            "id": rng.randint(10_000, 99_999),
            "price_eur": round(rng.uniform(20, 900), 2),
            "ok": rng.random() < 0.5,
        }
        for _ in range(rng.randint(1, 8))
    ]
    return json.dumps({"results": rows, "query": text(rng, 2, 6)})


def make_history(n_messages: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel agent. " + text(rng, 10, 30)}
    ]
    call = 0
    while len(out) < n_messages:
        out.append({"role": "user", "content": text(rng, 5, 40)})
        for _ in range(rng.randint(0, 3)):
            ids = [f"call_{call}_{k}" for k in range(rng.randint(1, 2))]
            call += 1
            fn = {"name": rng.choice(["search_flights", "search_hotels", "weather"])}
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": x,
                            "type": "function",
                            "function": {**fn, "arguments": json.dumps({"q": text(rng, 2, 6)})},
                        }
                        for x in ids
                    ],
                }
            )
            out += [{"role": "tool", "tool_call_id": x, "content": tool_result(rng)} for x in ids]
        out.append({"role": "assistant", "content": text(rng, 10, 60)})
    # End on a user question (the message the model is about to answer).
    while out[-1]["role"] != "user":
        out.pop()
    return out


def split_blocks(messages: list[dict[str, Any]]) -> int:
    """Tool calls shown without all their results, plus results shown without their call."""
    bad = 0
    open_ids: set[str] = set()
    for m in messages:
        if m["role"] == "tool":
            if m["tool_call_id"] not in open_ids:
                bad += 1
            open_ids.discard(m["tool_call_id"])
        else:
            bad += len(open_ids)
            open_ids = {c["id"] for c in m.get("tool_calls") or ()}
    return bad + len(open_ids)


def med_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def bench_size(
    n: int, seeds: int, repeats: int, counter: Any, truth: Any, context_tokens: int, max_new_tokens: int
) -> dict[str, Any]:
    from langchain_core.messages import convert_to_messages, convert_to_openai_messages, trim_messages

    import convo
    from convo.plan import fit

    prompt_budget = context_tokens - max_new_tokens
    budget = convo.Budget(
        context_tokens=context_tokens,
        max_new_tokens=max_new_tokens,
        window_turns=10**9,  # keep whatever fits, as trim_messages does
        pinned_tokens=prompt_budget // 2,
        recent_min_tokens=prompt_budget // 2,
    )
    rows: dict[str, dict[str, list[float]]] = {
        name: {"cold_s": [], "warm_s": [], "tokens": [], "violations": [], "split": []}
        for name in ("convo.fit", "trim_messages")
    }
    for seed in range(seeds):
        history = make_history(n, seed)
        counter._cache.clear()  # cold: every message counted once
        t = time.perf_counter()
        kept, _ = fit(history, budget=budget, counter=counter)
        rows["convo.fit"]["cold_s"].append(time.perf_counter() - t)
        for _ in range(repeats):
            t = time.perf_counter()
            kept, _ = fit(history, budget=budget, counter=counter)
            rows["convo.fit"]["warm_s"].append(time.perf_counter() - t)
        lc_history = convert_to_messages(history)
        for i in range(repeats + 1):
            t = time.perf_counter()
            trimmed = trim_messages(
                lc_history,
                max_tokens=prompt_budget,
                token_counter="approximate",
                strategy="last",
                include_system=True,
                start_on="human",
            )
            rows["trim_messages"]["cold_s" if i == 0 else "warm_s"].append(time.perf_counter() - t)
        for name, msgs in (("convo.fit", kept), ("trim_messages", convert_to_openai_messages(trimmed))):
            tokens = truth(msgs)
            rows[name]["tokens"].append(tokens)
            rows[name]["violations"].append(int(tokens > prompt_budget))
            rows[name]["split"].append(split_blocks(msgs))  # type: ignore[arg-type]
    out: dict[str, Any] = {"history_messages": n, "histories": seeds, "prompt_budget_tokens": prompt_budget}
    for name, r in rows.items():
        out[name] = {
            "cold_ms_per_call": med_ms(r["cold_s"]),
            "warm_ms_per_call": med_ms(r["warm_s"]),
            "budget_violations": int(sum(r["violations"])),
            "worst_overrun_tokens": max(0, int(max(r["tokens"])) - prompt_budget),
            "split_tool_blocks": int(sum(r["split"])),
            "mean_budget_used": round(statistics.mean(r["tokens"]) / prompt_budget, 3),
        }
    return out


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    sizes = [r["history_messages"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("convo.fit", "o-"), ("trim_messages", "s--")):
        ax1.plot(sizes, [r[name]["warm_ms_per_call"] for r in rows], style, label=f"{name} (warm)")
        if name == "convo.fit":
            ax1.plot(sizes, [r[name]["cold_ms_per_call"] for r in rows], "o:", label="convo.fit (cold)")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("history length (messages)")
    ax1.set_ylabel("ms per call (median)")
    ax1.legend()
    ax1.set_title("time per call")
    width = 0.35
    xs = range(len(sizes))
    for k, name in enumerate(("convo.fit", "trim_messages")):
        share = [r[name]["budget_violations"] / r["histories"] for r in rows]
        ax2.bar([x + (k - 0.5) * width for x in xs], share, width, label=name)
    ax2.set_xticks(list(xs), [str(s) for s in sizes])
    ax2.set_xlabel("history length (messages)")
    ax2.set_ylabel("share of calls over the budget")
    ax2.set_ylim(0, 1.05)
    ax2.legend()
    ax2.set_title(f"budget violations ({rows[0]['prompt_budget_tokens']} prompt tokens)")
    fig.suptitle("convo.fit vs langchain_core trim_messages, each with its default counter")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,1000,10000")
    p.add_argument("--seeds", default="20,10,3", help="histories per size")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per history after the first")
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--png", default="benchmarks/results/fit_vs_trim_messages.png")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    args = p.parse_args()

    from transformers import AutoTokenizer

    import convo
    from convo.engines.local.loading import default_model_path

    tok = AutoTokenizer.from_pretrained(str(default_model_path()), local_files_only=True)
    counter = convo.HFTokenCounter(tok, chat_template=TOOL_TEMPLATE)

    def truth(messages: list[dict[str, Any]]) -> int:
        rendered = [
            {**m, "content": m.get("content") or ""} for m in messages
        ]  # (the template needs strings)
        ids = tok.apply_chat_template(
            rendered, chat_template=TOOL_TEMPLATE, add_generation_prompt=True, tokenize=False
        )
        return len(tok(ids, add_special_tokens=False)["input_ids"])

    sizes = [int(x) for x in args.sizes.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    result: dict[str, Any] = {
        "benchmark": "fit_vs_trim_messages",
        "hardware": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor(),
        },
        "versions": {
            "python": sys.version.split()[0],
            **{pkg: metadata.version(pkg) for pkg in ("langchain-core", "transformers", "convo")},
        },
        "settings": {
            "context_tokens": args.context_tokens,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "truth": "SmolLM2 tokenizer, ChatML template with tool calls, generation prompt included",
        },
        "results": [],
    }
    for n, k in zip(sizes, seeds, strict=True):
        row = bench_size(n, k, args.repeats, counter, truth, args.context_tokens, args.max_new_tokens)
        result["results"].append(row)
        if not args.json:
            print(json.dumps(row), file=sys.stderr)
    if args.png:
        plot(result, args.png)
        result["png"] = args.png
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
