"""Calendar days in turn dates and in questions (convo.dates): pure logic."""

from __future__ import annotations

from datetime import date, datetime

import pytest

from convo.dates import DaySpan, as_day, day_label, parse_day, time_spans


@pytest.mark.parametrize(
    ("text", "day"),
    [
        ("1:56 pm on 8 May, 2023", date(2023, 5, 8)),  # LoCoMo's session dates
        ("10:37 am on 27 June, 2023", date(2023, 6, 27)),
        ("8 May 2023", date(2023, 5, 8)),
        ("8th of May 2023", date(2023, 5, 8)),
        ("May 8, 2023", date(2023, 5, 8)),
        ("Sept 3 2022", date(2022, 9, 3)),
        ("2023-05-08", date(2023, 5, 8)),
        ("2023-05-08T13:56:00Z", date(2023, 5, 8)),
        ("2023-05-08 13:56", date(2023, 5, 8)),
        ("8 May", None),  # no year: not a day
        ("31 February 2023", None),
        ("next Tuesday", None),
        ("", None),
    ],
)
def test_parse_day(text: str, day: date | None) -> None:
    assert parse_day(text) == day


def spans(query: str, years: tuple[int, ...] = (2022, 2023)) -> list[tuple[str, str]]:
    return [(s.first.isoformat(), s.last.isoformat()) for s in time_spans(query, years)]


def test_a_named_day() -> None:
    assert spans("What painting did Melanie show on October 13, 2023?") == [("2023-10-13", "2023-10-13")]
    assert spans("What did Gina find on 1 February, 2023?") == [("2023-02-01", "2023-02-01")]
    assert spans("What book did Tim finish on 8th December, 2023?") == [("2023-12-08", "2023-12-08")]
    assert spans("What did we discuss on 2023-05-08?") == [("2023-05-08", "2023-05-08")]
    # Without a year: that day in each year the turns span.
    assert spans("What happened on March 3?") == [("2022-03-03", "2022-03-03"), ("2023-03-03", "2023-03-03")]


def test_months_and_their_parts() -> None:
    assert spans("What did John do in August 2023?") == [("2023-08-01", "2023-08-31")]
    assert spans("Was the first half of September 2022 a good month?") == [("2022-09-01", "2022-09-15")]
    assert spans("Which tournament did Nate win in the beginning of November 2022?") == [
        ("2022-11-01", "2022-11-10")
    ]
    assert spans("What did she do at the end of February 2023?") == [("2023-02-21", "2023-02-28")]
    assert spans("Where was Tim in the second week of November?") == [
        ("2022-11-08", "2022-11-14"),
        ("2023-11-08", "2023-11-14"),
    ]
    assert spans("What happened in the last week of June 2023?") == [("2023-06-24", "2023-06-30")]
    assert spans("When did Melanie go camping in June?", (2023,)) == [("2023-06-01", "2023-06-30")]


def test_seasons_years_and_ranges() -> None:
    assert spans("What state did Joanna visit in summer 2021?") == [("2021-06-01", "2021-08-31")]
    assert spans("Where did they ski in winter 2022?") == [("2022-12-01", "2023-02-28")]
    assert spans("How many times did she go to the beach in 2023?") == [("2023-01-01", "2023-12-31")]
    assert spans("Where was John between August 11 and August 15 2023?") == [("2023-08-11", "2023-08-15")]
    assert spans("What happened between 2023-08-15 and 2023-08-11?") == [("2023-08-11", "2023-08-15")]


def test_bound_words_open_the_span() -> None:
    (upto,) = time_spans("How many pets did Andrew have, as of September 2023?")
    assert upto == DaySpan(date.min, date(2023, 9, 30))
    (before,) = time_spans("What did Maria do before April 10, 2023?")
    assert before == DaySpan(date.min, date(2023, 4, 10))
    (since,) = time_spans("What has changed since March 2023?")
    assert since == DaySpan(date(2023, 3, 1), date.max)


def test_no_calendar_expression_no_span() -> None:
    assert spans("Where did Caroline move from 4 years ago?") == []
    assert spans("What did you do last week?") == []  # relative: left to the text match
    assert spans("May I ask what you did?") == []  # "may" the verb
    assert spans("In 2 weeks I march on.") == []
    assert spans("Which of the 1,500 books?") == []


def test_ambiguous_month_words_need_context() -> None:
    assert spans("What did she plant in May?", (2023,)) == [("2023-05-01", "2023-05-31")]
    assert spans("We met in early March 2023.") == [("2023-03-01", "2023-03-10")]
    assert spans("Any plans for jun?") == []
    assert spans("What did he cook in jun 2023?") == [("2023-06-01", "2023-06-30")]


def test_relative_phrases_count_from_today() -> None:
    today = date(2026, 12, 1)  # a Tuesday

    def rel(query: str) -> list[tuple[str, str]]:
        return [(s.first.isoformat(), s.last.isoformat()) for s in time_spans(query, (2026,), today=today)]

    assert rel("What did I say yesterday?") == [("2026-11-30", "2026-11-30")]
    assert rel("and the day before yesterday?") == [("2026-11-29", "2026-11-29")]
    assert rel("What did we decide today?") == [("2026-12-01", "2026-12-01")]
    assert rel("three days ago") == [("2026-11-28", "2026-11-28")]
    assert rel("two weeks ago") == [("2026-11-14", "2026-11-20")]  # that week, give or take
    assert rel("a couple of months ago") == [("2026-10-01", "2026-10-31")]
    assert rel("What did we discuss last week?") == [("2026-11-23", "2026-11-29")]  # Monday to Sunday
    assert rel("this week") == [("2026-11-30", "2026-12-01")]
    assert rel("last month") == [("2026-11-01", "2026-11-30")]
    assert rel("last year") == [("2025-01-01", "2025-12-31")]
    assert rel("the past week") == [("2026-11-24", "2026-12-01")]
    assert rel("last weekend") == [("2026-11-28", "2026-11-29")]
    assert rel("last Friday") == [("2026-11-27", "2026-11-27")]
    assert rel("on Tuesday") == [("2026-11-24", "2026-11-24")]  # the latest one before today
    (since,) = time_spans("since last week", today=today)
    assert since == DaySpan(date(2026, 11, 23), date.max)
    assert rel("in June 2025 and yesterday") == [("2025-06-01", "2025-06-30"), ("2026-11-30", "2026-11-30")]
    assert time_spans("What did I say yesterday?") == []  # no today: not read


def test_as_day_reads_dates_datetimes_and_strings() -> None:
    assert as_day(None) is None
    assert as_day(date(2023, 5, 8)) == date(2023, 5, 8)
    assert as_day(datetime(2023, 5, 8, 13, 56)) == date(2023, 5, 8)
    assert as_day("1:56 pm on 8 May, 2023") == date(2023, 5, 8)
    assert as_day("someday") is None


def test_day_label_keeps_the_day_of_a_turn_date() -> None:
    assert day_label("10:37 am on 27 June, 2023") == "27 June 2023"
    assert day_label("2023-06-27 10:37") == "2023-06-27"
    assert day_label("last spring") == "last spring"


def test_longmemeval_dates_are_read() -> None:
    # LongMemEval dates its sessions "2023/05/20 (Sat) 02:21" (issue 24).
    assert parse_day("2023/05/20 (Sat) 02:21") == date(2023, 5, 20)
    assert as_day("2023/05/20 (Sat) 02:21") == date(2023, 5, 20)
    assert day_label("2023/05/20 (Sat) 02:21") == "2023/05/20 (Sat)"
    assert parse_day("2023/05-20") is None  # mixed separators are not a date
