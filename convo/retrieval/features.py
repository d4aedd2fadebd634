"""What the ranking derives per unit of one session's turns: :class:`UnitFeatures`.

Speakers, content sizes, episodes (the turns of one date) and their mean vectors, days and
conversation order are read from the store's records once, then kept up to date as turns
are indexed, so a question after a new turn costs only what that turn added.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from convo.dates import parse_day
from convo.retrieval.indexes.bm25 import terms
from convo.retrieval.units import Record, UnitStore


class UnitFeatures:
    """What the ranking reads per unit of one session's store, kept up to date as turns
    are indexed: each unit's speaker (and the speakers' names), content size, episode, day and
    conversation neighbours, and each episode's mean vector.

    In a chat the store changes before every question (the last turn is indexed), so
    :meth:`update` reads only the records added since it last ran: record ids only grow
    and a record never changes. When records were removed (``forget_turns``) or the
    conversation order would change, it rebuilds from every record.

    Besides the dictionaries, the per-unit facts a search reads for every candidate are
    kept as arrays indexed by unit id (:attr:`days`, :attr:`order`, :attr:`speaker_code`,
    :attr:`sizes`, :attr:`episode_index`, all of one length), so a search over thousands
    of candidates is a few array operations, not a loop (issue 24).
    """

    def __init__(self, episode_turns: int) -> None:
        self.episode_turns = episode_turns
        self.version = -1
        self.last_pid = -1
        self.records = 0
        self.speaker: dict[int, str] = {}
        self.speakers: set[str] = set()
        self.size: dict[int, int] = {}
        self.episode_of: dict[int, str] = {}
        self.episode_keys: list[str] = []
        self.centroids = np.zeros((0, 0), np.float32)  # normalized, in ``episode_keys`` order
        self._episode_row: dict[str, int] = {}
        self._sums = np.zeros((0, 0), np.float64)
        self._counts = np.zeros(0, np.int64)
        self.days = np.full(0, -1, np.int64)  # by unit id: a proleptic ordinal, -1: none
        self.years: set[int] = set()
        self.order = np.full((2, 0), -1, np.int64)  # by unit id: previous and next unit
        #: By unit id: the speaker's position in :attr:`speaker_names` (-1: none).
        self.speaker_code = np.full(0, -1, np.int64)
        #: Every speaker, in the order first seen (``speaker_code`` indexes it).
        self.speaker_names: list[str] = []
        self._speaker_row: dict[str, int] = {}
        #: By unit id: :attr:`size` as an array (0: none).
        self.sizes = np.zeros(0, np.int64)
        #: By unit id: the row of its episode in :attr:`episode_keys` and :attr:`centroids`.
        self.episode_index = np.full(0, -1, np.int64)
        self._last_unit = -1
        self._last_turn = -1

    def update(self, store: UnitStore) -> UnitFeatures:
        """Up to date with ``store``: this object, or a new one built from every record."""
        if self.version == store.version:
            return self
        new: list[tuple[int, Record]] = []
        for pid in reversed(store.records):  # record ids grow with insertion
            if pid <= self.last_pid:
                break
            new.append((pid, store.records[pid]))
        new.reverse()
        turn = [int(rec.meta.get("turn", 0)) for _, rec in new]
        if self.records + len(new) != len(store.records) or (turn and min(turn) < self._last_turn):
            return UnitFeatures(self.episode_turns).update(store)  # from every record
        self._add(store, new)
        self.version = store.version
        return self

    def speaking(self, names: Collection[str]) -> np.ndarray:
        """By unit id (bool, the length of :attr:`days`): whether the unit's speaker is one of
        ``names``."""
        rows = [name in names for name in self.speaker_names]
        return np.asarray([*rows, False], dtype=bool)[self.speaker_code]  # -1: the last slot

    def _add(self, store: UnitStore, new: list[tuple[int, Record]]) -> None:
        if not new:
            return
        self.last_pid = max(self.last_pid, max(pid for pid, _ in new))
        self.records += len(new)
        top = max((u for _, rec in new for u in rec.units), default=-1) + 1
        if top > len(self.days):
            cap = max(top, 2 * len(self.days))
            days = np.full(cap, -1, np.int64)
            days[: len(self.days)] = self.days
            order = np.full((2, cap), -1, np.int64)
            order[:, : self.order.shape[1]] = self.order
            self.days, self.order = days, order
            self.speaker_code = _grown(self.speaker_code, cap, -1)
            self.sizes = _grown(self.sizes, cap, 0)
            self.episode_index = _grown(self.episode_index, cap, -1)
        touched: dict[str, list[int]] = {}
        # Conversation order: by turn, ties in insertion order (a stable sort).
        for _, rec in sorted(new, key=lambda item: int(item[1].meta.get("turn", 0))):
            self._last_turn = max(self._last_turn, int(rec.meta.get("turn", 0)))
            for u in rec.units:
                if self._last_unit >= 0:
                    self.order[0, u], self.order[1, self._last_unit] = self._last_unit, u
                self._last_unit = u
        for _, rec in new:
            named = rec.meta.get("_speakers") or []
            self.speaker.update(zip(rec.units, named, strict=False))
            self.speakers.update(named[: len(rec.units)])
            for u, name in zip(rec.units, named, strict=False):
                row = self._speaker_row.get(name)
                if row is None:
                    row = self._speaker_row[name] = len(self.speaker_names)
                    self.speaker_names.append(name)
                self.speaker_code[u] = row
            lines = rec.meta.get("_lines") or [rec.text]
            sizes = [len(terms(line)) for line in lines]
            self.size.update(zip(rec.units, sizes, strict=False))
            for u, size in zip(rec.units, sizes, strict=False):
                self.sizes[u] = size
            date = rec.meta.get("date")
            key = f"date:{date}" if date else f"block:{int(rec.meta.get('turn', 0)) // self.episode_turns}"
            touched.setdefault(key, []).extend(rec.units)
            if key not in self._episode_row:
                self._episode_row[key] = len(self.episode_keys)
                self.episode_keys.append(key)
            for u in rec.units:
                self.episode_of[u] = key
                self.episode_index[u] = self._episode_row[key]
            day = parse_day(str(date or ""))
            if day is not None and rec.units:
                self.days[rec.units] = day.toordinal()
                self.years.add(day.year)
        if store.vectors is None:
            return
        k, dim = len(self.episode_keys), store.vectors.dim
        if self._sums.shape != (k, dim):
            sums = np.zeros((k, dim), np.float64)
            sums[: len(self._sums)] = self._sums if self._sums.size else 0.0
            counts = np.zeros(k, np.int64)
            counts[: len(self._counts)] = self._counts
            self._sums, self._counts = sums, counts
        rows = [self._episode_row[key] for key in touched]
        for row, units in zip(rows, touched.values(), strict=True):
            self._sums[row] += store.vectors.vectors(units).sum(axis=0, dtype=np.float64)
            self._counts[row] += len(units)
        if self.centroids.shape != (k, dim):
            cents = np.zeros((k, dim), np.float32)
            cents[: len(self.centroids)] = self.centroids if self.centroids.size else 0.0
            self.centroids = cents
        means = self._sums[rows] / np.maximum(self._counts[rows], 1)[:, None]
        self.centroids[rows] = means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)


def _grown(a: np.ndarray, size: int, fill: int) -> np.ndarray:
    """``a`` copied into a new array of ``size`` (at least ``len(a)``), the rest ``fill``."""
    out = np.full(size, fill, a.dtype)
    out[: len(a)] = a
    return out
