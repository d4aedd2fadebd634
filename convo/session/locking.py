"""A session's turn lock: turns of one session run one at a time, across tasks, threads
and processes.

Three locks nest, outermost first:

1. an ``asyncio.Lock`` (async turns only): the tasks of one loop driving this
   :class:`~convo.session.Session` object queue here;
2. the session object's ``threading.RLock``: a thread mid-turn (an async turn polls it
   every :data:`TURN_LOCK_POLL_S`, so the loop never blocks);
3. the store's lock on the session (:meth:`convo.stores.Store.lock`: a file lock for
   SQLite, a lease for Redis): another process, or another ``Session`` object on the
   same store and id. A blocking turn waits in the store's own call; an async turn tries
   it without waiting (``store.lock(id, 0)``) every :data:`STORE_LOCK_POLL_S`. Both give
   up with :class:`~convo.errors.SessionBusy` after the session's ``lock_timeout_s``.

The store's lock is reentrant per thread (a session used inside ``with store.lock(id):``
does not wait for itself), and every task of an event loop runs on the loop's thread; so
an async turn also waits while another task of this process holds the store's lock on the
same session (:data:`_ASYNC_TURNS`). Whoever takes the store's lock afresh catches up
with the store first (another process may have added turns).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from convo.errors import SessionBusy
from convo.stores import Store

#: How often an async turn checks whether a thread's turn on the same session has ended,
#: in seconds.
TURN_LOCK_POLL_S = 0.005
#: How often an async turn tries the store's lock on its session while another turn
#: (another process, thread or task) holds it, in seconds.
STORE_LOCK_POLL_S = 0.01

#: The async turns of this process that hold a store's lock on a session:
#: (id(store), session id) -> the task.
_ASYNC_TURNS: dict[tuple[int, str], asyncio.Task[Any]] = {}


class TurnLock:
    """The turn lock of one :class:`~convo.session.Session` object.

    Args:
        store / session_id: the session whose store lock the turns hold.
        catch_up: called on a fresh hold of the store's lock (reload what others stored).
        after_turn: called when a turn (:meth:`turn`, :meth:`aturn`, :meth:`local_turn`)
            has let go: work the turn's hold kept out, such as a prefill. While this thread
            still holds the session's store lock (an outer turn, or a server request that
            holds it around the turn), when that lets go. After an async turn it runs in a
            worker thread (it may read the store), and only when ``after_turn_due`` says
            there is work.
        after_turn_due: whether ``after_turn`` has work now (default: always).
    """

    def __init__(
        self,
        store: Store,
        session_id: str,
        catch_up: Callable[[], None],
        after_turn: Callable[[], None] | None = None,
        after_turn_due: Callable[[], bool] | None = None,
    ) -> None:
        self.store = store
        self.session_id = session_id
        self._catch_up = catch_up
        self._after_turn = after_turn
        self._after_turn_due = after_turn_due
        #: Held by a thread mid-turn (also around work that must not overlap a turn).
        self.local = threading.RLock()
        self._alock: asyncio.Lock | None = None

    @contextlib.contextmanager
    def turn(self, timeout_s: float) -> Iterator[None]:
        """:meth:`hold` for a turn: ``after_turn`` runs once it has let go."""
        try:
            with self.hold(timeout_s):
                yield
        finally:
            self._let_go()

    @contextlib.asynccontextmanager
    async def aturn(self, timeout_s: float) -> AsyncIterator[None]:
        """:meth:`ahold` for a turn: ``after_turn`` runs once it has let go."""
        try:
            async with self.ahold(timeout_s):
                yield
        finally:
            if self._owes_after_turn():  # (off the loop: it may wait on the store)
                await asyncio.to_thread(self._after_turn)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def local_turn(self) -> Iterator[None]:
        """Only this object's side (:attr:`local`), for work that must not overlap a turn;
        ``after_turn`` runs once it has let go."""
        try:
            with self.local:
                yield
        finally:
            self._let_go()

    def _let_go(self) -> None:
        if self._owes_after_turn():
            self._after_turn()  # type: ignore[misc]
        elif self._after_turn is not None and self.store.holds_lock(self.session_id):
            # An outer holder of the store's lock (a server request around the turn): the work
            # waits until it lets go (Store.after_release), then runs if it is still due.
            self.store.after_release(self.session_id, self._let_go)

    def _owes_after_turn(self) -> bool:
        if self._after_turn is None or self.store.holds_lock(self.session_id):
            return False
        return self._after_turn_due is None or self._after_turn_due()

    @contextlib.contextmanager
    def hold(self, timeout_s: float) -> Iterator[None]:
        """Hold the turn, blocking; :class:`SessionBusy` after ``timeout_s`` on the store."""
        with self.local:
            fresh = not self.store.holds_lock(self.session_id)
            with self.store.lock(self.session_id, timeout_s):
                if fresh:
                    self._catch_up()
                yield

    @contextlib.asynccontextmanager
    async def ahold(self, timeout_s: float) -> AsyncIterator[None]:
        """:meth:`hold` on the event loop: the same locks, waited for without blocking it."""
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            while not self.local.acquire(blocking=False):
                await asyncio.sleep(TURN_LOCK_POLL_S)
            try:
                with contextlib.ExitStack() as held:
                    await self._take_store_lock(held, timeout_s)
                    yield
            finally:
                self.local.release()

    async def _take_store_lock(self, held: contextlib.ExitStack, timeout_s: float) -> None:
        """Enter the store's lock into ``held``, tried every :data:`STORE_LOCK_POLL_S`."""
        key, me = (id(self.store), self.session_id), asyncio.current_task()
        deadline = time.monotonic() + timeout_s
        while True:
            holder = _ASYNC_TURNS.get(key)
            if holder is None or holder is me:
                fresh = not self.store.holds_lock(self.session_id)
                try:
                    held.enter_context(self.store.lock(self.session_id, 0))
                    break
                except SessionBusy:
                    pass
            if time.monotonic() >= deadline:
                raise SessionBusy(
                    f"session {self.session_id!r} is busy with another turn (waited {timeout_s:.0f} s)"
                )
            await asyncio.sleep(STORE_LOCK_POLL_S)
        if holder is None and me is not None:
            _ASYNC_TURNS[key] = me
            held.callback(_ASYNC_TURNS.pop, key, None)
        if fresh:
            self._catch_up()
