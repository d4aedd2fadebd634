"""Planning a prompt: which parts of a conversation go into the next request.

:func:`plan_prompt` is a pure function of the pinned messages, the rolling summary, the
candidate retrieved passages, the recent turns, the budget and a token counter. It does no
I/O and calls no model; the session summarizes, retrieves and stores around it.

::

    | system (pinned) | summary | retrieved | recent turns          | reserve for reply |
      never evicted     <= cap    <= cap,     newest first, whole     max_new_tokens
      + tool schemas              top-k       turns; >= recent_min

The diagram shows the shares. In the prompt the memory message (the retrieved passages)
sits inside the turn being answered, right after its user message: system, summary,
earlier turns, the question, memory, and the rest of the turn (an agent's tool calls and
results). What comes before it changes only when the window slides, so the next turn's
prompt extends this one up to the question and an engine that keeps the KV cache between
turns reuses it, even though each turn retrieves different passages: only the reply and
the new turn are prefilled (with memory before the question, the previous question was
prefilled again too). Within one turn of an agent loop the memory stays the same (its
query is the turn's user message), so each step reuses the whole prompt before it.

The recent turns are fitted newest first and only whole turns are shown, except the newest
turn, which always keeps its first message and its newest blocks (a block is an assistant
tool call with all its results: it is never split). A message too large for the room left
is shortened in the middle or refused, as the budget's ``oversize`` policy says.

Retrieved passages are taken best first; one that does not fit is skipped and smaller ones
after it still fill the room, counted exactly. The room the recent turns leave unused
(whole turns rarely fill their share to the token) goes back to retrieval, within
``retrieval_tokens``; the turns shown stay the same.

:func:`plan_checked` re-checks a plan against the exact count of the rendered prompt;
:func:`fit` applies it to a list of OpenAI message dicts that the caller owns (agent loops).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol, Required, TypedDict, Unpack, runtime_checkable

from convo.budget import Budget, OversizePolicy
from convo.errors import BudgetError, ConfigError, MessageError
from convo.messages import Message, MessageLike, Role, group_blocks
from convo.tokens import TokenCounter, Tool

#: How the rolling summary is shown to the model (a system message).
SUMMARY_HEADER = "Summary of the earlier conversation:\n"
#: How a retrieved passage is shown to the model (one system message each).
PASSAGE_TEMPLATE = "Relevant memory ({source}):\n{text}"
#: The first line of the one system message that carries every grouped passage (passages
#: with ``meta["group"]``, e.g. messages of earlier turns tagged with their day).
MEMORY_HEADER = "Relevant memory:"
#: How a group's label opens its lines in that message.
GROUP_LABEL = "[{group}]"


@dataclass(frozen=True, kw_only=True)
class Passage:
    """A retrieved piece of text offered to the planner.

    Args:
        text: the passage as it should appear in the prompt.
        score: relevance, higher is better (the retriever's scale).
        source: where it comes from, for citation (``"notes.md:120-380"``, ``"turn 12"``).
        key: identity for de-duplication; passages of this session's own turns use
            ``turn_key(index)`` so the planner can drop those already in the window.
        meta: anything else the retriever wants to report (positions, dates...).
    """

    text: str
    score: float
    source: str
    key: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)


def turn_key(index: int, line: int | None = None) -> str:
    """The de-duplication key of a passage that is turn ``index``, or its message ``line``."""
    return f"turn:{index}" if line is None else f"turn:{index}:{line}"


def _whole_turn_key(key: str) -> str:
    """``"turn:12:1"`` -> ``"turn:12"``; other keys unchanged."""
    parts = key.split(":")
    return f"turn:{parts[1]}" if len(parts) == 3 and parts[0] == "turn" else key


@dataclass(frozen=True, kw_only=True)
class Turn:
    """A turn as the planner sees it: its number in the session and its messages."""

    index: int
    messages: tuple[Message, ...]


@dataclass(frozen=True, kw_only=True)
class DroppedPassage:
    """A passage the planner did not use, and why (``"top_k"``, ``"token_cap"``,
    ``"min_score"``, ``"in_window"`` or ``"duplicate"``)."""

    passage: Passage
    reason: str


@dataclass(frozen=True, kw_only=True)
class PromptPlan:
    """What the next request will contain.

    Attributes:
        messages: the messages to render, in order.
        parts: tokens per part: ``system``, ``tools`` (the function-tool schemas the
            call offers, pinned beside the system part; 0 without tools), ``summary``,
            ``retrieved``, ``recent``, ``template`` (tokens the chat template adds around
            messages) and ``reserve`` (the reply reserve, ``max_new_tokens``).
        prompt_tokens: tokens of the rendered prompt (all parts but ``reserve``), tool
            schemas included.
        context_tokens: the budget's context size.
        turns_shown: indices of the turns shown (whole or in part), oldest first.
        first_shown_turn: every turn before this index is out of the prompt.
        truncated_messages: how many messages the TRUNCATE policy shortened.
        dropped_blocks: blocks of the newest turn left out for lack of room.
        passages_used: passages in the prompt, in order.
        passages_dropped: candidates left out, with the reason.
        summary_truncated: the summary was cut to fit.
    """

    messages: tuple[Message, ...]
    parts: Mapping[str, int]
    prompt_tokens: int
    context_tokens: int
    turns_shown: tuple[int, ...]
    first_shown_turn: int
    truncated_messages: int = 0
    dropped_blocks: int = 0
    passages_used: tuple[Passage, ...] = ()
    passages_dropped: tuple[DroppedPassage, ...] = ()
    summary_truncated: bool = False

    @property
    def total_tokens(self) -> int:
        """Prompt plus reply reserve: never more than ``context_tokens``."""
        return self.prompt_tokens + self.parts["reserve"]


def summary_message(summary: str) -> Message:
    """The system message that carries the rolling summary."""
    return Message(role=Role.SYSTEM, content=SUMMARY_HEADER + summary)


def passage_message(passage: Passage) -> Message:
    """The system message that carries one retrieved passage."""
    return Message(
        role=Role.SYSTEM, content=PASSAGE_TEMPLATE.format(source=passage.source, text=passage.text)
    )


def _group(p: Passage) -> str | None:
    group = p.meta.get("group")
    return group if isinstance(group, str) and group else None


def _order(p: Passage) -> tuple[int, int]:
    turn, line = p.meta.get("turn"), p.meta.get("line")
    return (turn if isinstance(turn, int) else 0, line if isinstance(line, int) else 0)


def group_message(group: str, passages: Sequence[Passage]) -> Message:
    """The system message that carries the passages of one group: see :func:`groups_message`."""
    return groups_message({group: passages})


def groups_message(groups: Mapping[str, Sequence[Passage]]) -> Message:
    """The one system message that carries grouped passages (``meta["group"]``, e.g. the
    day of the turns they come from): :data:`MEMORY_HEADER`, then per group its label
    (:data:`GROUP_LABEL`) and its passages' texts, groups and passages in conversation
    order (``meta["turn"]``, ``meta["line"]``) when known.

    One message with a short label per group costs far less than a message with a header
    per group, so more evidence fits in the same tokens.
    """
    ordered = sorted(
        ((g, sorted(ps, key=_order)) for g, ps in groups.items() if ps), key=lambda x: (_order(x[1][0]), x[0])
    )
    body = "\n".join(GROUP_LABEL.format(group=g) + "\n" + "\n".join(p.text for p in ps) for g, ps in ordered)
    return Message(role=Role.SYSTEM, content=f"{MEMORY_HEADER}\n{body}")


def passage_messages(passages: Sequence[Passage]) -> list[Message]:
    """The messages that carry ``passages``: one per passage, except that all grouped
    passages share one message (:func:`groups_message`, placed where the first of them is)."""
    out: list[Message] = []
    groups: dict[str, list[Passage]] = {}
    slot: int | None = None
    for p in passages:
        g = _group(p)
        if g is None:
            out.append(passage_message(p))
            continue
        groups.setdefault(g, []).append(p)
        if slot is None:
            slot = len(out)
            out.append(passage_message(p))  # placeholder, replaced below
    if slot is not None:
        out[slot] = groups_message(groups)
    return out


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _fit_messages(
    messages: Sequence[Message], room: int, counter: TokenCounter, policy: OversizePolicy
) -> tuple[list[Message], int, int] | None:
    """Shorten the largest messages of ``messages`` until they fit ``room`` tokens.

    Returns ``(messages, tokens, n_truncated)`` or ``None`` when they cannot fit.
    Raises BudgetError under the RAISE policy when shortening would be needed.
    """
    out = list(messages)
    costs = [counter.message_tokens(m) for m in out]
    truncated: set[int] = set()
    for _ in range(8):
        excess = sum(costs) - room
        if excess <= 0:
            return out, sum(costs), len(truncated)
        if policy is OversizePolicy.RAISE:
            raise BudgetError(
                f"a message needs {sum(costs)} tokens but only {room} are left for it "
                "(oversize policy RAISE); shorten it or raise context_tokens"
            )
        i = max(range(len(out)), key=lambda j: costs[j])
        content_tokens = counter.count_text(out[i].content)
        target = content_tokens - excess - 2  # seams can re-tokenize a little longer
        if target <= 0:
            return None
        out[i] = replace(out[i], content=counter.truncate_middle(out[i].content, target))
        costs[i] = counter.message_tokens(out[i])
        truncated.add(i)
    return None


class _Shown:
    """The turns shown, for :func:`_repeats_window`: their keys and normalized texts,
    computed once per set of shown turns (not once per candidate passage)."""

    def __init__(self, window: Sequence[Turn], shown: set[int]) -> None:
        self.keys = {turn_key(i) for i in shown}
        self.texts = {_norm(m.content) for t in window if t.index in shown for m in t.messages if m.content}


def _repeats_window(p: Passage, shown: _Shown) -> bool:
    """Whether passage ``p`` repeats a turn among those ``shown`` (by key or by text)."""
    if p.key and _whole_turn_key(p.key) in shown.keys:
        return True
    return _norm(p.text) in shown.texts


def _memory(used: Sequence[tuple[Passage, int]], counter: TokenCounter) -> tuple[list[Message], int]:
    """The memory message(s) of the chosen passages and their exact token count."""
    msgs = passage_messages([p for p, _ in used])
    return msgs, sum(counter.message_tokens(m) for m in msgs)


def _select_passages(
    passages: Sequence[Passage],
    shown: _Shown,
    room: int,
    budget: Budget,
    counter: TokenCounter,
    min_score: float,
    *,
    first: Sequence[Passage] = (),
) -> tuple[list[tuple[Passage, int]], list[DroppedPassage]]:
    """Best-first passages within ``room`` tokens and top-k, skipping weak and repeated ones.

    One that does not fit is skipped and smaller ones after it still fill the room.
    ``first`` (passages an earlier pass chose) are taken before the others, so a pass
    with more room keeps them and adds to them.

    A grouped passage costs what it adds to the one grouped message (its line, plus its
    group's label when it opens the group, plus the message itself when it is the first).
    Those pieces, counted apart, overstate the joined message a little, so before a
    passage is refused for room the chosen ones are counted exactly; the result is held
    to the exact count at the end.
    """
    ordered = list(passages)
    if first:
        chosen = {id(p) for p in first}
        ordered = [*first, *(p for p in passages if id(p) not in chosen)]
    used: list[tuple[Passage, int]] = []
    dropped: list[DroppedPassage] = []
    seen: set[str] = set()
    total = 0
    synced = True  # total is the exact count of the messages chosen so far
    groups: dict[str, list[Passage]] = {}
    for p in ordered:
        norm = _norm(p.text)
        reason = None
        if p.score < min_score:
            reason = "min_score"
        elif _repeats_window(p, shown):
            reason = "in_window"
        elif (p.key and p.key in seen) or norm in seen:
            reason = "duplicate"
        elif len(used) >= budget.retrieval_top_k:
            reason = "top_k"
        else:
            g = _group(p)
            if g is None:
                cost = counter.message_tokens(passage_message(p))
            else:  # what joining the grouped message adds
                piece = p.text if g in groups else GROUP_LABEL.format(group=g) + "\n" + p.text
                cost = counter.count_text("\n" + piece)
                if not groups:
                    cost += counter.message_tokens(Message(role=Role.SYSTEM, content=MEMORY_HEADER))
            if total + cost > room and not synced:
                # The pieces' own counts overstate the joined message (a line's last token
                # and the newline after it often merge): count it exactly before giving up.
                total = _memory(used, counter)[1]
                synced = True
            if total + cost > room:
                reason = "token_cap"
            else:
                used.append((p, cost))
                total += cost
                synced = synced and g is None
                seen.update(x for x in (p.key, norm) if x)
                if g is not None:
                    groups.setdefault(g, []).append(p)
        if reason is not None:
            dropped.append(DroppedPassage(passage=p, reason=reason))
    # Tokens can merge across the joins: hold the exact count to the room.
    while groups:
        exact = sum(counter.message_tokens(m) for m in passage_messages([p for p, _ in used]))
        if exact <= room:
            break
        i = max(i for i, (p, _) in enumerate(used) if _group(p) is not None)
        last = used.pop(i)[0]
        members = groups[_group(last) or ""]
        members.remove(last)
        if not members:
            del groups[_group(last) or ""]
        dropped.append(DroppedPassage(passage=last, reason="token_cap"))
    return used, dropped


def _fit_recent(
    window: Sequence[Turn], turn_costs: Sequence[int], room: int, counter: TokenCounter, budget: Budget
) -> tuple[list[list[Message]], list[int], int, int, int]:
    """Fit turns newest first into ``room`` tokens.

    Older turns are shown whole or not at all; the newest keeps its first block and its
    newest blocks, shortened under the oversize policy if it must be.

    Returns:
        ``(turn message lists, shown turn indices, tokens, truncated messages, dropped blocks)``,
        oldest first.
    """
    recent: list[list[Message]] = []
    shown: list[int] = []
    recent_cost = truncated = dropped_blocks = 0
    for pos in range(len(window) - 1, -1, -1):
        turn, cost = window[pos], turn_costs[pos]
        if recent_cost + cost <= room:
            recent.append(list(turn.messages))
            shown.append(turn.index)
            recent_cost += cost
            continue
        if pos != len(window) - 1:
            break  # older turns are shown whole or not at all
        # The newest turn does not fit: keep its first block and its newest blocks.
        msgs = list(turn.messages)
        blocks = group_blocks(msgs)
        head = msgs[blocks[0][0] : blocks[0][1]]
        tail_blocks: list[list[Message]] = []
        left = room - sum(counter.message_tokens(m) for m in head)
        for start, end in reversed(blocks[1:]):
            block = msgs[start:end]
            c = sum(counter.message_tokens(m) for m in block)
            if c > left:
                break
            tail_blocks.insert(0, block)
            left -= c
        dropped_blocks = len(blocks) - 1 - len(tail_blocks)
        fitted: tuple[list[Message], int, int] | None
        if not tail_blocks and len(blocks) > 1:
            # Even the newest block does not fit beside the head: shorten the two.
            dropped_blocks = len(blocks) - 2
            fitted = _fit_messages(head + msgs[blocks[-1][0] : blocks[-1][1]], room, counter, budget.oversize)
        elif left < 0:
            fitted = _fit_messages(head + [m for b in tail_blocks for m in b], room, counter, budget.oversize)
        else:
            flat = head + [m for b in tail_blocks for m in b]
            fitted = (flat, sum(counter.message_tokens(m) for m in flat), 0)
        if fitted is None:
            raise BudgetError(
                f"the newest turn cannot fit in the {room} tokens left after the system prompt "
                "and reserve, even shortened; raise context_tokens or lower max_new_tokens"
            )
        recent.append(fitted[0])
        shown.append(turn.index)
        recent_cost += fitted[1]
        truncated = fitted[2]
        break
    recent.reverse()
    shown.reverse()
    return recent, shown, recent_cost, truncated, dropped_blocks


def plan_prompt(
    *,
    budget: Budget,
    counter: TokenCounter,
    turns: Sequence[Turn],
    pinned: Sequence[Message] = (),
    summary: str = "",
    passages: Sequence[Passage] = (),
    min_score: float = float("-inf"),
    tools: Sequence[Tool] = (),
) -> PromptPlan:
    """Plan the next prompt under ``budget``.

    Args:
        budget: the token budget.
        counter: counts tokens with the model's tokenizer and chat template.
        turns: candidate turns, oldest first; only the last ``budget.window_turns`` are
            considered. The last turn is the one being answered.
        pinned: system prompt and pinned facts, never evicted.
        summary: the rolling summary of older turns (``""`` for none).
        passages: retrieved candidates, best first.
        min_score: passages scoring below this are dropped.
        tools: OpenAI function tools the call offers. Their schemas travel with every call,
            so they are pinned: counted (:meth:`TokenCounter.count_tools`) with the pinned
            messages against ``budget.pinned_cap``, in ``parts["tools"]``.

    Returns:
        A :class:`PromptPlan` whose ``prompt_tokens + max_new_tokens <= context_tokens``
        when the counter is additive (the session re-checks with an exact count).

    Raises:
        BudgetError: the pinned part (pinned messages and tool schemas) exceeds its cap, or
            a message is too large and the oversize policy is RAISE (or nothing can make it
            fit).
    """
    overhead = max(counter.overhead_tokens(True), counter.overhead_tokens(False))
    avail = budget.available_prompt_tokens - overhead
    pinned = list(pinned)
    pinned_cost = sum(counter.message_tokens(m) for m in pinned)
    tools_cost = counter.count_tools(tools) if tools else 0
    if pinned_cost + tools_cost > budget.pinned_cap:
        what = f"pinned messages take {pinned_cost} tokens"
        if tools_cost:
            what += f" and the {len(tools)} tool schema(s) {tools_cost}"
        raise BudgetError(
            f"{what}, over pinned_tokens={budget.pinned_cap}; "
            + ("send fewer or shorter tools, " if tools_cost else "")
            + "unpin something or raise the cap"
        )
    avail -= pinned_cost + tools_cost

    window = list(turns[-budget.window_turns :])
    turn_costs = [sum(counter.message_tokens(m) for m in t.messages) for t in window]
    need = sum(turn_costs)
    guaranteed = min(need, budget.recent_min, max(avail, 0))
    extra_room = max(avail - guaranteed, 0)

    # -- summary ---------------------------------------------------------------------------
    summary_msgs: list[Message] = []
    summary_cost = 0
    summary_truncated = False
    if summary and budget.summary_tokens > 0:
        room = min(extra_room, budget.summary_tokens + counter.message_tokens(summary_message("")))
        msg = summary_message(summary)
        cost = counter.message_tokens(msg)
        if cost > room:
            header_cost = counter.message_tokens(summary_message(""))
            text = counter.truncate_middle(summary, max(room - header_cost - 2, 0))
            msg = summary_message(text)
            cost = counter.message_tokens(msg)
            summary_truncated = True
            if not text or cost > room:
                msg, cost = None, 0  # type: ignore[assignment]
        if msg is not None:
            summary_msgs, summary_cost = [msg], cost
    extra_room -= summary_cost

    # -- retrieved passages ----------------------------------------------------------------
    # Passages repeating a turn that will be shown anyway are dropped. Which turns are shown
    # depends on how much retrieval takes, so: turns that fit even if retrieval takes its
    # whole cap are certainly shown; select passages against those; fit the recent turns;
    # then drop any passage whose turn made it into the prompt after all, and refit.
    cap = min(max(extra_room, 0), budget.retrieval_cap)
    try:
        certain = _fit_recent(window, turn_costs, avail - summary_cost - cap, counter, budget)[1]
    except BudgetError:
        certain = []
    used, dropped = _select_passages(passages, _Shown(window, set(certain)), cap, budget, counter, min_score)
    retrieved_msgs, retrieved_cost = _memory(used, counter)
    recent, shown, recent_cost, truncated, dropped_blocks = _fit_recent(
        window, turn_costs, avail - summary_cost - retrieved_cost, counter, budget
    )
    for _ in range(3):
        on_show = _Shown(window, set(shown))
        late = [(p, c) for p, c in used if _repeats_window(p, on_show)]
        if not late:
            break
        used = [(p, c) for p, c in used if (p, c) not in late]
        dropped += [DroppedPassage(passage=p, reason="in_window") for p, _ in late]
        retrieved_msgs, retrieved_cost = _memory(used, counter)
        recent, shown, recent_cost, truncated, dropped_blocks = _fit_recent(
            window, turn_costs, avail - summary_cost - retrieved_cost, counter, budget
        )
    # Recent turns are shown whole, so they rarely take all the room retrieval left them
    # (their guaranteed share included): what they leave goes back to retrieval, within
    # retrieval_tokens, keeping what it chose. The turns shown stay the same.
    room = min(budget.retrieval_cap, avail - summary_cost - recent_cost)
    if room > retrieved_cost and any(d.reason == "token_cap" for d in dropped):
        used, dropped = _select_passages(
            passages,
            _Shown(window, set(shown)),
            room,
            budget,
            counter,
            min_score,
            first=[p for p, _ in used],
        )
        retrieved_msgs, retrieved_cost = _memory(used, counter)

    # Memory goes inside the turn being answered, after its user message: what precedes it
    # (system, summary, earlier turns, the question) stays the prefix of the next turn's
    # prompt, so its KV is reused instead of re-run whenever the retrieved passages change.
    earlier = [m for t in recent[:-1] for m in t]
    current = list(recent[-1]) if recent else []
    asked = 1 if current and current[0].role is Role.USER else 0
    messages = tuple(pinned + summary_msgs + earlier + current[:asked] + retrieved_msgs + current[asked:])
    starts_system = bool(messages) and messages[0].role is Role.SYSTEM
    template = counter.overhead_tokens(starts_system)
    parts = {
        "system": pinned_cost,
        "tools": tools_cost,
        "summary": summary_cost,
        "retrieved": retrieved_cost,
        "recent": recent_cost,
        "template": template,
        "reserve": budget.max_new_tokens,
    }
    first_shown = shown[0] if shown else (window[-1].index + 1 if window else 0)
    return PromptPlan(
        messages=messages,
        parts=parts,
        prompt_tokens=pinned_cost + tools_cost + summary_cost + retrieved_cost + recent_cost + template,
        context_tokens=budget.context_tokens,
        turns_shown=tuple(shown),
        first_shown_turn=first_shown,
        truncated_messages=truncated,
        dropped_blocks=dropped_blocks,
        passages_used=tuple(p for p, _ in used),
        passages_dropped=tuple(dropped),
        summary_truncated=summary_truncated,
    )


#: How many times :func:`plan_checked` re-plans when the exact count of the rendered prompt
#: exceeds the planner's sum (each attempt holds the difference back).
EXACT_REPLAN_ATTEMPTS = 4


class PlanInputs(TypedDict, total=False):
    """What :func:`plan_prompt` plans from, besides the budget (its arguments of the same
    names; ``counter`` and ``turns`` are required)."""

    counter: Required[TokenCounter]
    turns: Required[Sequence[Turn]]
    pinned: Sequence[Message]
    summary: str
    passages: Sequence[Passage]
    min_score: float
    tools: Sequence[Tool]


def plan_checked(*, budget: Budget, exact: bool = False, **inputs: Unpack[PlanInputs]) -> PromptPlan:
    """:func:`plan_prompt`, checked against the count of the rendered prompt.

    When the counter is not additive (or ``exact`` is set), the planned messages are
    rendered through the counter's chat template and counted; if the template costs more
    than the per-message sum, the difference is held back and the prompt re-planned, so
    ``plan.prompt_tokens <= budget.available_prompt_tokens`` (context minus the reply reserve
    and ``margin_tokens``) always holds for the returned plan, and ``prompt_tokens`` is the
    exact count. Pure: no I/O.

    Args:
        budget: the token budget.
        exact: re-count the rendered prompt even when the counter is additive.
        **inputs: :class:`PlanInputs`, as for :func:`plan_prompt`.

    Raises:
        BudgetError: as :func:`plan_prompt`, or the prompt still does not fit after
            :data:`EXACT_REPLAN_ATTEMPTS` attempts.
    """
    counter = inputs["counter"]
    held_back = 0
    for _ in range(EXACT_REPLAN_ATTEMPTS):
        try:
            b = budget if held_back == 0 else replace(budget, margin_tokens=budget.margin_tokens + held_back)
        except ConfigError as exc:
            raise BudgetError(f"the chat template leaves no room for this prompt: {exc}") from exc
        plan = plan_prompt(budget=b, **inputs)
        # An additive counter's sum is exact (the engine re-checks the real length).
        tools = inputs.get("tools") or ()
        if counter.additive and not exact:
            count = plan.prompt_tokens
        elif tools:  # the prompt rendered with the schemas where the template puts them
            count = counter.count_with_tools(plan.messages, tools)
        else:
            count = counter.count_prompt(plan.messages)
        if count <= budget.available_prompt_tokens:  # the margin stays free too
            if count != plan.prompt_tokens:
                parts = dict(plan.parts)
                parts["template"] += count - plan.prompt_tokens
                plan = replace(plan, prompt_tokens=count, parts=parts)
            return replace(plan, context_tokens=budget.context_tokens)
        held_back += count - budget.available_prompt_tokens
    raise BudgetError(f"could not fit the prompt in the budget after {EXACT_REPLAN_ATTEMPTS} attempts")


# -- fit: a message list the caller owns (agent loops) ------------------------------------


def _is_pinned(message: MessageLike) -> bool:
    if type(message) is dict or isinstance(message, Mapping):  # (the exact type test is fast)
        return message.get("role") in ("system", "developer") or bool(message.get("pinned"))
    return isinstance(message, Message) and message.pinned


def _candidate_turns(
    messages: Sequence[MessageLike], budget: Budget, counter: TokenCounter
) -> tuple[list[Message], list[Turn], dict[int, Mapping[str, Any]]]:
    """The pinned messages and the turns :func:`plan_prompt` could show, parsed.

    Walks back from the newest message and stops at the first turn boundary past
    ``budget.window_turns`` turns or past ``budget.available_prompt_tokens`` tokens: the
    planner shows older turns only whole and only newest first, so nothing before that
    point can be shown, and an agent loop's 10k-message history costs what its window
    costs. Turn indices count every turn of the history.

    Returns:
        ``(pinned, turns, originals)``: ``originals`` maps ``id(parsed message)`` to the
        caller's dict.
    """
    originals: dict[int, Mapping[str, Any]] = {}

    def parse(raw: MessageLike) -> Message:
        m = Message.from_openai(raw)
        if not isinstance(raw, Message):
            originals[id(m)] = raw
        return m

    is_pinned = [_is_pinned(m) for m in messages]
    pinned = [parse(m) for m, p in zip(messages, is_pinned, strict=True) if p]
    limit = budget.available_prompt_tokens
    reversed_turns: list[list[Message]] = []
    current: list[Message] = []
    cost = 0
    stop = 0  # messages before this index cannot be shown
    for i in range(len(messages) - 1, -1, -1):
        if is_pinned[i]:
            continue
        m = parse(messages[i])
        current.append(m)
        cost += counter.message_tokens(m)
        if m.role is Role.USER:
            reversed_turns.append(current[::-1])
            current = []
            if len(reversed_turns) >= budget.window_turns or cost > limit:
                stop = i
                break
    if current:
        reversed_turns.append(current[::-1])
    skipped = [m for m, p in zip(messages[:stop], is_pinned, strict=False) if not p]
    first_index = sum(1 for m in skipped if _starts_turn(m))
    if skipped and not _starts_turn(skipped[0]):
        first_index += 1  # messages before the first user message form turn 0
    flat = [m for t in reversed(reversed_turns) for m in t]
    group_blocks(flat)  # a tool result that answers no call is an error, not a silent drop
    turns = [Turn(index=first_index + k, messages=tuple(t)) for k, t in enumerate(reversed(reversed_turns))]
    return pinned, turns, originals


def _starts_turn(message: MessageLike) -> bool:
    if type(message) is dict or isinstance(message, Mapping):
        return message.get("role") == "user"
    return isinstance(message, Message) and message.role is Role.USER


@runtime_checkable
class Retriever(Protocol):
    """A retrieval memory: passages about a question, from turns handed to it (e.g.
    :class:`convo.RetrievalMemory`).

    :func:`fit` and :class:`~convo.session.Session` ask :meth:`retrieve` for passages about
    the newest user message and let the planner drop those scoring below
    :attr:`min_score` (``-inf`` when the object has none). A session also hands it each
    completed turn, once, through :meth:`remember_turns`; :func:`fit` never does (it owns no
    history), so an object given only to :func:`fit` needs only :meth:`retrieve`.
    (``PassageSource``, this protocol's former name in this module, is a deprecated alias.)

    Capabilities are declared, never probed: subclass ``Retriever`` to inherit the defaults
    (``min_score = -inf``: keep every passage; ``supports_today = False``: :meth:`retrieve`
    takes no ``today=``), or declare both attributes.
    """

    #: Passages scoring below this are dropped by the planner.
    min_score: float = float("-inf")
    #: :meth:`retrieve` takes ``today=`` (a date), to read "yesterday" or "last week".
    supports_today: bool = False

    def remember_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> None:
        """Index ``turns`` of ``session_id`` (``dates``: turn index -> its date). The default
        indexes nothing (a retriever over a fixed corpus)."""
        return None

    def retrieve(self, query: str, *, session_id: str, top_k: int) -> list[Passage]:
        """At most ``top_k`` passages about ``query``, best first (a retriever that declares
        ``supports_today`` also takes ``today=``: the date the question is asked on)."""
        ...


@runtime_checkable
class PreparesTurns(Protocol):
    """A :class:`Retriever` that can do the costly part of :meth:`~Retriever.remember_turns`
    (embedding) ahead, off a turn's path: a :class:`~convo.session.Session` calls
    :meth:`prepare_turns` in a background thread after each reply, so that the next
    turn's indexing finds its vectors computed (:class:`convo.RetrievalMemory` and the
    server's memory declare it by defining the method)."""

    #: The turns a session hands over are searched by that session alone: a turn its prompt
    #: still shows (whose passages would be dropped) is handed over when it leaves the
    #: window (or as :meth:`turns_ready` says), its vectors computed ahead meanwhile; until
    #: then a turn embeds neither them nor its question. ``False``: every completed turn at
    #: once (a memory shared by several sessions, e.g. a person's).
    defer_window_turns: bool

    def prepare_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        """Compute ahead what indexing ``turns`` of ``session_id`` will need; index nothing.
        Returns how many texts were embedded."""
        ...

    def turns_ready(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        """How many of ``turns`` (completed turns the window still shows, from the first)
        to index now rather than when they leave the window: 0, or all of them where the
        index is built on this turn anyway (the server's, rebuilt from the store after a
        restart or on another replica: every turn not stored is caught up then)."""
        ...


def check_retriever(retriever: object) -> None:
    """Refuse a retriever that does not declare what :class:`Retriever` declares.

    Raises:
        ConfigError: it lacks ``retrieve``, ``min_score`` or ``supports_today``.
    """
    if retriever is not None and not isinstance(retriever, Retriever):
        raise ConfigError(
            f"{type(retriever).__name__} is not a convo.plan.Retriever: subclass it, or declare "
            "min_score, supports_today, retrieve() and remember_turns()"
        )


class Fitted(NamedTuple):
    """What :func:`fit` returns: unpack it as ``messages, plan = fit(...)``.

    Attributes:
        messages: OpenAI message dicts for the model, in order.
        plan: the plan report: tokens per part, turns shown, dropped blocks, passages.
    """

    messages: list[dict[str, Any]]
    plan: PromptPlan


def split_turns(messages: Sequence[Message]) -> list[Turn]:
    """Cut unpinned messages into turns: each user message starts one (messages before
    the first user message form turn 0)."""
    turns: list[list[Message]] = []
    for m in messages:
        if m.role is Role.USER or not turns:
            turns.append([])
        turns[-1].append(m)
    return [Turn(index=i, messages=tuple(t)) for i, t in enumerate(turns)]


def fit(
    messages: Sequence[MessageLike],
    *,
    budget: Budget,
    counter: TokenCounter,
    summary: str | None = None,
    retriever: Retriever | None = None,
    session_id: str = "",
) -> Fitted:
    """The messages to send the model now, within ``budget``: for agent loops that own
    their message list.

    The same pure planner as :class:`~convo.session.Session` (:func:`plan_checked`), with
    these rules:

    * System (and ``developer``) messages are pinned: all are kept, ahead of the
      conversation, in their order. They must fit ``budget.pinned_tokens``.
    * The conversation is cut into turns at user messages. Older turns are kept whole,
      newest first, while they fit (and at most ``budget.window_turns`` of them). The
      newest turn keeps its first message (the task) and as many of its newest blocks as
      fit.
    * A block is an assistant message with tool calls plus every tool result answering
      it: it is kept whole or dropped whole, never split.
    * The result never exceeds the budget: ``plan.prompt_tokens + budget.max_new_tokens
      <= budget.context_tokens``, where ``prompt_tokens`` is the count of the rendered
      prompt through the counter's chat template (for
      :class:`~convo.tokens.HFTokenCounter`), not a sum of per-message estimates.
    * Messages kept unchanged come back as the very dicts you passed (extra keys intact);
      a message shortened by the ``TRUNCATE`` policy, the summary and retrieved passages
      come back as new dicts.

    Only the messages that could be shown are parsed and validated (walking back from the
    newest, up to ``budget.window_turns`` turns or a prompt's worth of tokens), so a call
    costs what the window costs, not what the history costs. No I/O, no model call:
    ``summary`` is a text you keep up to date; ``retriever`` is asked for passages about
    the newest user message.

    Args:
        messages: the whole history, oldest first: OpenAI message dicts
            (:meth:`Message.from_openai` reads them) or :class:`Message` objects.
        budget: the token budget (``max_new_tokens`` is held back for the reply).
        counter: counts tokens with the model's tokenizer and chat template, e.g.
            ``engine.counter`` or ``TiktokenCounter()`` for a hosted model (then give the
            budget a ``margin_tokens``, as the count is an estimate of another tokenizer).
        summary: a summary of turns you dropped earlier, shown as a system message (cut to
            ``budget.summary_tokens``).
        retriever: asked for ``budget.retrieval_top_k`` passages about the newest user
            message; those that fit ``budget.retrieval_tokens`` and do not repeat a shown
            turn are shown as system messages.
        session_id: passed to the retriever.

    Returns:
        :class:`Fitted` ``(messages, plan)``.

    Raises:
        MessageError: a message is malformed, or a tool result does not follow the call
            it answers.
        BudgetError: the system messages exceed ``budget.pinned_tokens``, or the newest
            turn cannot fit even shortened (or ``budget.oversize`` is RAISE).

    Example:
        >>> from convo import Budget, fit
        >>> from convo.tokens import CharCounter
        >>> history = [{"role": "system", "content": "Be brief."}] + [
        ...     {"role": "user", "content": f"question {i} " * 20} for i in range(50)]
        >>> kept, plan = fit(history, budget=Budget(context_tokens=512, max_new_tokens=64),
        ...                  counter=CharCounter())
        >>> plan.prompt_tokens + 64 <= 512, kept[0]["content"]
        (True, 'Be brief.')
    """
    plan, originals = _fit(
        messages, budget=budget, counter=counter, summary=summary, retriever=retriever, session_id=session_id
    )
    out = []
    for m in plan.messages:
        original = originals.get(id(m))
        if original is None:
            out.append(m.to_openai())
        else:
            out.append(original if isinstance(original, dict) else dict(original))
    return Fitted(messages=out, plan=plan)


class FitArgs(TypedDict, total=False):
    """The keyword arguments of :func:`fit` and :func:`fit_plan` (``budget`` and
    ``counter`` are required; see :func:`fit`)."""

    budget: Required[Budget]
    counter: Required[TokenCounter]
    summary: str | None
    retriever: Retriever | None
    session_id: str


def fit_plan(messages: Sequence[MessageLike], **kwargs: Unpack[FitArgs]) -> PromptPlan:
    """:func:`fit`, returning only the plan: its ``messages`` are :class:`Message` objects,
    the very objects passed in for those kept unchanged (adapters map them back to their
    own message types by identity). The arguments are :func:`fit`'s."""
    return _fit(messages, **kwargs)[0]


def _fit(
    messages: Sequence[MessageLike], **kwargs: Unpack[FitArgs]
) -> tuple[PromptPlan, dict[int, Mapping[str, Any]]]:
    unknown = kwargs.keys() - FitArgs.__annotations__.keys()
    if unknown:  # (as a signature would)
        raise TypeError(f"fit() got unexpected keyword arguments {sorted(unknown)}")
    budget, counter = kwargs["budget"], kwargs["counter"]
    summary, retriever = kwargs.get("summary"), kwargs.get("retriever")
    session_id = kwargs.get("session_id", "")
    if not isinstance(budget, Budget):
        raise ConfigError(f"fit() needs budget=Budget(...), got {type(budget).__name__}")
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes, Mapping)):
        raise MessageError("fit() takes a list of messages")
    check_retriever(retriever)
    pinned, turns, originals = _candidate_turns(messages, budget, counter)
    rest = [m for t in turns for m in t.messages]
    passages: list[Passage] = []
    if retriever is not None and budget.retrieval_cap > 0 and budget.retrieval_top_k > 0:
        query = next((m.content for m in reversed(rest) if m.role is Role.USER), "")
        if query:
            passages = retriever.retrieve(query, session_id=session_id, top_k=budget.retrieval_top_k)
    plan = plan_checked(
        budget=budget,
        counter=counter,
        turns=turns,
        pinned=pinned,
        summary=summary or "",
        passages=passages,
        min_score=float(retriever.min_score) if retriever is not None else float("-inf"),
        exact=bool(messages),  # count through the template (which refuses an empty list)
    )
    return plan, originals


def __getattr__(name: str) -> Any:
    if name == "PassageSource":  # the same protocol's former name, kept for one release
        warnings.warn(
            "convo.plan.PassageSource is deprecated; use convo.plan.Retriever",
            DeprecationWarning,
            stacklevel=2,
        )
        return Retriever
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
