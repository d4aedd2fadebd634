"""Calendar days in turn dates and the time a question asks about.

Retrieval uses both for time-aware scoring: a question that names a time ("in June 2023",
"on 3 June, 2023", "the first half of September 2022", "between August 11 and August 15
2023") favours the turns of those days. Relative phrases ("yesterday", "last week", "three
days ago", "last Friday") are read only when the day they count from is known (``today``:
the date of the turn that asks, see ``Session(clock=...)``).

:func:`parse_day` reads the dates callers give turns (``Session.add(..., date=...)``):
``"1:56 pm on 8 May, 2023"``, ``"8 May 2023"``, ``"May 8, 2023"``, ``"2023-05-08"``,
``"2023-05-08T13:56"``. :func:`time_spans` reads a question.
"""

from __future__ import annotations

import calendar
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, datetime, timedelta

__all__ = ["DaySpan", "as_day", "day_label", "parse_day", "time_spans"]

_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_name) if name}
_MONTHS.update({name.lower(): i for i, name in enumerate(calendar.month_abbr) if name})
_MONTHS["sept"] = 9
_MONTH = r"(?P<{}>" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_DAY = r"(?P<{}>[0-3]?\d)(?:st|nd|rd|th)?"
_YEAR = r"(?P<{}>(?:19|20)\d\d)"


def _m(name: str) -> str:
    return _MONTH.format(name)


# "8 May, 2023", "8th of May 2023", "May 8, 2023", "May 8th" (the year optional).
_DMY = rf"{_DAY.format('d1')}\s+(?:of\s+)?{_m('m1')}(?:,?\s+{_YEAR.format('y1')})?"
_MDY = rf"{_m('m2')}\s+{_DAY.format('d2')}(?!\d)(?:,?\s+{_YEAR.format('y2')})?"
# "2023-05-08", and "2023/05/20 (Sat) 02:21" as LongMemEval dates its sessions.
_ISO = r"(?P<iy>(?:19|20)\d\d)(?P<sep>[-/])(?P<im>[01]\d)(?P=sep)(?P<id>[0-3]\d)(?=T|\b)"
_DAY_RE = re.compile(rf"\b(?:{_ISO}|(?:{_DMY}|{_MDY})\b)", re.I)

_PART = (
    r"(?P<part>first\s+half|second\s+half|beginning|start|early|middle|mid|end|late|"
    r"(?:first|second|third|fourth|last)\s+week)"
)
_MONTH_RE = re.compile(
    rf"\b(?:{_PART}(?:\s+of|-)?\s+)?{_m('m')}(?:,?\s+(?:of\s+)?{_YEAR.format('y')})?\b", re.I
)
_SEASON_RE = re.compile(r"\b(?P<s>spring|summer|fall|autumn|winter)(?:\s+of)?\s+(?P<y>(?:19|20)\d\d)\b", re.I)
_YEAR_RE = re.compile(r"\b(?P<y>(?:19|20)\d\d)\b")
_BOUND_RE = re.compile(r"\b(?P<b>as\s+of|by|before|until|after|since)\s*$", re.I)
_TIME_OF_DAY = re.compile(r"^\s*\d{1,2}[:.]\d{2}(?:[:.]\d{2})?\s*(?:[ap]\.?m\.?)?\s*(?:on\s+|,\s*)?", re.I)

# Month words that are also common words: a month only with a year, a part of the month
# or a word like "in" before them.
_AMBIGUOUS = frozenset({"may", "march"})
_LEAD_RE = re.compile(
    r"\b(?:in|during|of|since|until|by|before|after|early|late|mid|this|last|next)\s+$", re.I
)

_COUNT = r"(?P<n>\d{1,3}|a|an|one|two|three|four|five|six|seven|eight|nine|ten|a\s+couple\s+of|a\s+few)"
_NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}
_NUMBERS.update({"eight": 8, "nine": 9, "ten": 10})
_WEEKDAYS = {name.lower(): i for i, name in enumerate(calendar.day_name)}
_RELATIVE_RE = re.compile(
    r"\b(?:(?P<dby>(?:the\s+)?day\s+before\s+yesterday)|(?P<yesterday>yesterday)|(?P<today>today|tonight)"
    rf"|{_COUNT}\s+(?P<unit>day|week|month|year)s?\s+ago"
    r"|(?P<which>last|this|past)\s+(?P<period>week(?:end)?|month|year)"
    rf"|(?P<on>last|on|this\s+past)\s+(?P<wd>{'|'.join(_WEEKDAYS)})s?)\b",
    re.I,
)

_SEASONS = {"spring": (3, 5), "summer": (6, 8), "fall": (9, 11), "autumn": (9, 11), "winter": (12, 14)}


@dataclass(frozen=True)
class DaySpan:
    """Days ``first`` to ``last``, both included, that a question names."""

    first: date
    last: date


def _day(year: int, month: int, day: int) -> date | None:
    try:
        return date(year, month, day)
    except ValueError:
        return None


def _month_span(year: int, month: int, part: str | None) -> DaySpan:
    last = calendar.monthrange(year, month)[1]
    lo, hi = 1, last
    p = re.sub(r"\s+", " ", (part or "").lower())
    if p == "first half":
        hi = 15
    elif p == "second half":
        lo = 16
    elif p in ("beginning", "start", "early"):
        hi = 10
    elif p in ("middle", "mid"):
        lo, hi = 11, 20
    elif p in ("end", "late"):
        lo = 21
    elif p.endswith("week"):
        n = {"first": 0, "second": 1, "third": 2, "fourth": 3}.get(p.split()[0])
        lo, hi = (last - 6, last) if n is None else (1 + 7 * n, 7 + 7 * n)
    return DaySpan(date(year, month, lo), date(year, month, hi))


@functools.lru_cache(maxsize=8192)
def parse_day(text: str) -> date | None:
    """The calendar day of a turn's date string, or ``None`` when it names none.

    Reads ``"1:56 pm on 8 May, 2023"``, ``"8 May 2023"``, ``"May 8, 2023"``,
    ``"2023-05-08"``, ``"2023/05/20 (Sat) 02:21"`` (LongMemEval) and ISO date-times; a date
    without a year is ``None``.
    """
    m = _DAY_RE.search(_TIME_OF_DAY.sub("", text.strip(), count=1))
    if m is None:
        return None
    if m.group("iy"):
        return _day(int(m.group("iy")), int(m.group("im")), int(m.group("id")))
    for d, mo, y in (("d1", "m1", "y1"), ("d2", "m2", "y2")):
        if m.group(mo) and m.group(y):
            return _day(int(m.group(y)), _MONTHS[m.group(mo).lower()], int(m.group(d)))
    return None


def _bounded(span: DaySpan, query: str, start: int) -> DaySpan:
    """``span`` opened on one side when the words before it say "as of", "by", "after" ..."""
    b = _BOUND_RE.search(query[:start])
    if b is None:
        return span
    if b.group("b").lower() in ("after", "since"):
        return DaySpan(span.first, date.max)
    return DaySpan(date.min, span.last)


def _months_back(day: date, n: int) -> tuple[int, int]:
    """The (year, month) ``n`` calendar months before ``day``'s."""
    index = day.year * 12 + day.month - 1 - n
    return index // 12, index % 12 + 1


def _relative(m: re.Match[str], today: date) -> DaySpan:
    """The span of one relative phrase, counted from ``today``."""
    if m.group("dby"):
        day = today - timedelta(days=2)
        return DaySpan(day, day)
    if m.group("yesterday"):
        day = today - timedelta(days=1)
        return DaySpan(day, day)
    if m.group("today"):
        return DaySpan(today, today)
    if m.group("unit"):
        word = re.sub(r"\s+", " ", m.group("n").lower())
        n = 2 if word == "a couple of" else 3 if word == "a few" else _NUMBERS.get(word) or int(word)
        unit = m.group("unit").lower()
        if unit == "day":
            day = today - timedelta(days=n)
            return DaySpan(day, day)
        if unit == "week":  # "two weeks ago": that week, give or take half of it
            mid = today - timedelta(days=7 * n)
            return DaySpan(mid - timedelta(days=3), mid + timedelta(days=3))
        if unit == "month":
            return _month_span(*_months_back(today, n), None)
        return DaySpan(date(today.year - n, 1, 1), date(today.year - n, 12, 31))
    if m.group("period"):
        which, period = m.group("which").lower(), m.group("period").lower()
        monday = today - timedelta(days=today.weekday())
        if period == "weekend":  # the last Saturday and Sunday before today
            sunday = today - timedelta(days=(today.weekday() + 1) % 7 or 7)
            return DaySpan(sunday - timedelta(days=1), sunday)
        if which == "past":  # "the past week": the days up to today
            length = {"week": 7, "month": 30, "year": 365}[period]
            return DaySpan(today - timedelta(days=length), today)
        if period == "week":
            if which == "last":
                return DaySpan(monday - timedelta(days=7), monday - timedelta(days=1))
            return DaySpan(monday, today)
        if period == "month":
            if which == "this":
                return DaySpan(today.replace(day=1), today)
            return _month_span(*_months_back(today, 1), None)
        if which == "this":
            return DaySpan(date(today.year, 1, 1), today)
        return DaySpan(date(today.year - 1, 1, 1), date(today.year - 1, 12, 31))
    # "last Friday", "on Friday": the latest such day before today.
    back = (today.weekday() - _WEEKDAYS[m.group("wd").lower()]) % 7 or 7
    day = today - timedelta(days=back)
    return DaySpan(day, day)


def time_spans(query: str, years: Iterable[int] = (), *, today: date | None = None) -> list[DaySpan]:
    """The spans of days ``query`` names, most specific expressions first.

    Args:
        query: a question, e.g. ``"What did Maria do in the first half of May 2023?"``.
        years: years a month or day named without one may fall in (the years of the
            stored turns); without them such a month or day is ignored.
        today: the day relative phrases count from; ``None`` (default) ignores them.

    Returns:
        Day spans: a day (``"on 3 June, 2023"``), a month or part of one (``"in June
        2023"``, ``"the second week of November"``), a season of a year (``"summer
        2021"``), a year (``"in 2023"``), or a range (``"between August 11 and August 15
        2023"``). A bound word opens the span on one side: ``"as of"``, ``"by"``,
        ``"before"``, ``"until"`` (everything up to it), ``"after"``, ``"since"``
        (everything from it). With ``today``, also relative phrases: ``"today"``,
        ``"yesterday"``, ``"the day before yesterday"``, ``"three days ago"`` (also weeks,
        months, years), ``"last week"``, ``"this month"``, ``"the past year"``, ``"last
        weekend"``, ``"last Friday"`` or ``"on Friday"`` (the latest Friday before today).
        ``[]`` when the question names no time.
    """
    known = sorted(set(years))
    taken = [False] * len(query)
    spans: list[DaySpan] = []

    def free(m: re.Match[str]) -> bool:
        return not any(taken[m.start() : m.end()])

    def take(m: re.Match[str]) -> None:
        taken[m.start() : m.end()] = [True] * (m.end() - m.start())

    days: list[tuple[re.Match[str], list[date]]] = []
    found: list[date | None]
    for m in _DAY_RE.finditer(query):
        if m.group("iy"):
            found = [_day(int(m.group("iy")), int(m.group("im")), int(m.group("id")))]
        else:
            g_day, g_month, g_year = ("d1", "m1", "y1") if m.group("m1") else ("d2", "m2", "y2")
            month, day_n = _MONTHS[m.group(g_month).lower()], int(m.group(g_day))
            in_years = [int(m.group(g_year))] if m.group(g_year) else known
            found = [_day(yr, month, day_n) for yr in in_years]
        valid = [f for f in found if f is not None]
        if valid:
            days.append((m, valid))
            take(m)
    # "between August 11 and August 15 2023": one range; the first day takes the
    # second's year when it has none.
    if len(days) >= 2 and re.search(r"\bbetween\b", query[: days[0][0].start()], re.I):
        (m1, a), (m2, b) = days[0], days[1]
        if re.fullmatch(r"\s*(?:and|to|-)\s*", query[m1.end() : m2.start()], re.I):
            first = a[0] if len(a) == 1 else _day(b[-1].year, a[0].month, a[0].day) or a[0]
            spans.append(DaySpan(min(first, b[-1]), max(first, b[-1])))
            days = days[2:]
    for m, valid in days:
        spans.extend(_bounded(DaySpan(f, f), query, m.start()) for f in valid)
    for m in _MONTH_RE.finditer(query):
        if not free(m):
            continue
        word = m.group("m").lower()
        if (
            (word in _AMBIGUOUS or len(word) <= 4)
            and not (m.group("y") or m.group("part"))
            and not _LEAD_RE.search(query[: m.start()])
        ):
            continue  # "May I ask", "I march on", "jan": a month only after "in", "of" ...
        in_years = [int(m.group("y"))] if m.group("y") else known
        spans.extend(
            _bounded(_month_span(yr, _MONTHS[word], m.group("part")), query, m.start()) for yr in in_years
        )
        take(m)
    for m in _SEASON_RE.finditer(query):
        if not free(m):
            continue
        year = int(m.group("y"))
        lo, hi = _SEASONS[m.group("s").lower()]
        end_y, end_m = (year + 1, hi - 12) if hi > 12 else (year, hi)
        spans.append(
            _bounded(
                DaySpan(date(year, lo, 1), date(end_y, end_m, calendar.monthrange(end_y, end_m)[1])),
                query,
                m.start(),
            )
        )
        take(m)
    if today is not None:
        for m in _RELATIVE_RE.finditer(query):
            if free(m):
                spans.append(_bounded(_relative(m, today), query, m.start()))
                take(m)
    for m in _YEAR_RE.finditer(query):
        if free(m):
            year = int(m.group("y"))
            spans.append(_bounded(DaySpan(date(year, 1, 1), date(year, 12, 31)), query, m.start()))
            take(m)
    return spans


_ISO_DAY = re.compile(r"^(\d{4}-\d{2}-\d{2})[T ]\d{2}:\d{2}\S*$")
# LongMemEval's "2023/05/20 (Sat) 02:21": the day with its weekday, without the time.
_SLASH_DAY = re.compile(r"^(\d{4}/\d{2}/\d{2}(?:\s*\(\w{3}\))?)\s+\d{1,2}:\d{2}$")


@functools.lru_cache(maxsize=4096)
def day_label(date: str) -> str:
    """The day of a turn's date, as a short group label: the time of day is dropped
    (``"1:56 pm on 8 May, 2023"`` -> ``"8 May 2023"``, ``"2023-05-08T13:56"`` ->
    ``"2023-05-08"``, ``"2023/05/20 (Sat) 02:21"`` -> ``"2023/05/20 (Sat)"``); a date in
    another form is kept as it is."""
    text = date.strip()
    m = _ISO_DAY.match(text)
    if m:
        return m.group(1)
    m = _SLASH_DAY.match(text)
    if m:
        return m.group(1)
    day = _TIME_OF_DAY.sub("", text, count=1)
    day = re.sub(r",\s*(\d{4})\b", r" \1", day).strip()
    return day or text


def as_day(value: date | str | None) -> date | None:
    """A day from a ``date``, a ``datetime`` or a date string (read by :func:`parse_day`);
    ``None`` when it has none."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date):
        return value
    return parse_day(str(value))
