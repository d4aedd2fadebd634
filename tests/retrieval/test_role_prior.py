"""RetrievalConfig.role_weight: in a chat between a person and an assistant, the side the
question asks about is favoured (the person's own messages, unless the question asks what
the assistant said earlier); conversations between named speakers are left alone."""

from __future__ import annotations

import pytest
from conftest import HashEncoder

from convo.messages import Message, Role
from convo.plan import Turn, turn_key
from convo.retrieval import RetrievalConfig, RetrievalMemory
from convo.retrieval.ranking import asked_role, role_boosted

# The assistant's reply repeats the question's words more than the user's fact does.
CHAT = [
    (
        "My dog Biscuit is a beagle, I adopted him in spring.",
        "Beagles like your dog are lovely! A beagle dog needs long walks; for a beagle dog "
        "try a harness, and beagle dog food with protein.",
    ),
    ("Can you recommend a good book on gardening?", "Try 'The Well-Tempered Garden'."),
]

#: Two sessions on two days (a session's first message is not read with the last reply).
DATES = {0: "1 May 2023", 1: "9 May 2023"}


def turns(named: bool) -> list[Turn]:
    out = []
    for i, (user, reply) in enumerate(CHAT):
        out.append(
            Turn(
                index=i,
                messages=(
                    Message(role=Role.USER, content=user, name="Ann" if named else None),
                    Message(role=Role.ASSISTANT, content=reply, name="Bob" if named else None),
                ),
            )
        )
    return out


@pytest.mark.parametrize(
    ("question", "side"),
    [
        ("What breed is my dog?", "user"),
        ("Can you suggest some activities I can do in the evening?", "user"),
        ("You recommended a harness for my dog, which one was it?", "assistant"),
        ("In our previous chat you suggested dog food; what brand?", "assistant"),
        ("What dog food did you recommend?", "assistant"),
        ("Can you remind me of that restaurant that serves great Nasi Goreng?", None),
    ],
)
def test_asked_role_reads_who_the_question_is_about(question: str, side: str | None) -> None:
    assert asked_role(question) == side


def test_role_boosted_adds_the_weight_to_the_asked_side_only() -> None:
    fused = {0: 0.5, 1: 0.5, 2: 0.5}
    speaker = {0: "user", 1: "assistant", 2: "Ann"}
    assert role_boosted(fused, speaker, "What is my dog's name?", 0.2) == {0: 0.7, 1: 0.5, 2: 0.5}
    assert role_boosted(fused, speaker, "What did you recommend?", 0.2) == {0: 0.5, 1: 0.7, 2: 0.5}
    assert role_boosted(fused, speaker, "What is my dog's name?", 0.0) == fused
    assert role_boosted(fused, speaker, "Remind me of that dog's name?", 0.2) == fused  # either side


def best(memory: RetrievalMemory, question: str) -> str:
    return memory.retrieve(question, session_id="s", top_k=1)[0].key


@pytest.mark.parametrize("weight", [0.0, 0.3])
def test_role_weight_finds_the_persons_own_fact(weight: float) -> None:
    memory = RetrievalMemory(
        HashEncoder(), config=RetrievalConfig(min_score=0.0, role_weight=weight, neighbour_weight=0.0)
    )
    memory.remember_turns("s", turns(named=False), dates=DATES)
    question = "What breed is my beagle dog?"
    # Without the prior the long reply that repeats the words wins; with it, the user's line.
    assert best(memory, question) == (turn_key(0, 0) if weight else turn_key(0, 1))
    # Asked what the assistant said, its reply is found either way.
    assert best(memory, "What beagle dog food did you suggest?") == turn_key(0, 1)


def test_role_weight_leaves_named_speakers_alone() -> None:
    def ranked(weight: float) -> list[str]:
        memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0, role_weight=weight))
        memory.remember_turns("s", turns(named=True), dates=DATES)
        return [p.key for p in memory.retrieve("What breed is my beagle dog?", session_id="s", top_k=3)]

    assert ranked(0.3) == ranked(0.0)
