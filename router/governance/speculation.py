"""An agent step sent on before the shared store numbered it (store.url set).

A step of a run this replica knows (it took the run's previous step within
`SPECULATE_WITHIN_S`, and its own state shows the run neither stopped nor at `max_steps`)
does not wait at `Governor.enter` for the store's answer (its step number, home, counters, a
stop set on another replica, and for a governed step its concurrency slot): it is placed and
sent to the engine on the number this replica knows plus one, while the statement is in
flight. The request path then holds the response until the answer is in:

    spec = governor.speculation(request_id)    None: the step waited at `enter` as before
    spec.watch(task)                           a refusal cancels `task` (the engine request)
    ... dispatch, the engine's response head ...
    spec.unwatch(); await spec.wait()          before the response's first byte
    spec.error                                 the refusal the client gets (403, 429, 503)
    spec.step                                  the store's number (headers, ledger)

The governor reads the answer (`on_answer`, called once, when it comes): a stop or a refused
slot becomes `error` (and cancels the watched task); another number (another replica took
steps meanwhile) replaces the known one; the step stays where it ran.

A known run's non-streaming step that needs no request slot goes further when the ledger
commits on PostgreSQL (s44): no statement is sent for it at all until its response's record
is committed, and that one statement numbers the step too (`DeferredStep`, handed to the
settlement, router/settlement.py):

    step = governor.deferred_step(outcome)     None: numbered already (or not a run's step)
    row = await ledger.commit_numbered(record, step.sql, step.params)
    error = step.read_row(row)                 the refusal the client gets instead (403)

so the step costs no round trip of its own; a refusal (a stop or `max_steps` reached on
another replica) is then found after the engine's work, and the client gets it instead of
the response (docs/replicas.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from router.governance.shared import NextStep

__all__ = ["SPECULATE_WITHIN_S", "DeferredStep", "Speculation"]

# how recently this replica must have seen the run's previous step to send the next one on
# before the store answers (past that another replica has likely taken it over)
SPECULATE_WITHIN_S = 10.0


class Speculation:
    """One step sent on before the store's answer; see the module's docstring."""

    __slots__ = (
        "_cancelled",
        "_on_answer",
        "_watcher",
        "awaited",
        "closed",
        "error",
        "label",
        "predicted",
        "resolved",
        "step",
        "task",
    )

    def __init__(
        self,
        task: asyncio.Task[Any],
        predicted: int,
        on_answer: Callable[[Speculation], None],
    ) -> None:
        self.task = task  # the store's answer: (admitted, slot holder, NextStep | None)
        self.predicted = predicted  # the number this replica knew
        self.step = predicted  # the store's, once it answered (the known one if it could not)
        self.error: BaseException | None = None  # the refusal the client gets instead
        self.label: str | None = None  # confirmed, renumbered, refused, unanswered
        self.resolved = False
        self.closed = False  # the request ended before the answer came
        self.awaited = False  # `wait` came before the answer: the response waited for it
        self._on_answer = on_answer
        self._watcher: asyncio.Task[Any] | None = None
        self._cancelled = False  # a refusal cancelled the watched task
        task.add_done_callback(self._answered)

    def _answered(self, _: object = None) -> None:
        if self.resolved:
            return
        self.resolved = True
        self._on_answer(self)
        if self.error is not None and self._watcher is not None and not self._watcher.done():
            self._cancelled = True
            self._watcher.cancel()
        self._watcher = None

    def watch(self, task: asyncio.Task[Any] | None) -> None:
        """A refusal cancels `task` (serving the request) until `unwatch`."""
        if not self.resolved:
            self._watcher = task

    def unwatch(self) -> None:
        self._watcher = None

    def refusal(self, task: asyncio.Task[Any] | None) -> BaseException | None:
        """The refusal, when a `CancelledError` in `task` was this speculation's doing (its
        cancellation is taken back); None when the cancellation was someone else's too
        (the client left, the server stops)."""
        if not self._cancelled or self.error is None or task is None:
            return None
        self._cancelled = False
        if task.uncancel() > 0:
            return None
        return self.error

    async def wait(self) -> None:
        """Until the store's answer is read (`error`, `step`). Cancelling the caller leaves
        the statement running (its answer is still read: a slot is given back)."""
        if not self.resolved:
            self.awaited = True
            try:
                await asyncio.shield(self.task)
            except asyncio.CancelledError:
                if not self.task.done():
                    raise  # the caller was cancelled, not the statement
            except Exception:
                pass  # read by `on_answer`, as the task's exception
            self._answered()


class DeferredStep:
    """A known run's step sent on without any statement: numbered by the statement that
    commits its ledger record (`sql`, `params`: the step's upsert, whose row the ledger's
    statement returns; its parameters taken when read), or, when the ledger cannot commit
    that way now, by `number()`.
    `read_row` / `read` take the answer once and return the refusal the client gets
    instead of the response (None: served, under the store's number)."""

    __slots__ = ("_number", "_on_answer", "_params", "predicted", "sql", "step")

    def __init__(
        self,
        sql: str,
        params: Sequence[object] | Callable[[], Sequence[object]],
        predicted: int,
        number: Callable[[], Awaitable[NextStep | None]],
        on_answer: Callable[[NextStep | None, bool], BaseException | None],
    ) -> None:
        self.sql = sql
        self._params = params
        self.predicted = predicted  # the number this replica knew
        self.step = predicted  # the store's, once read (the known one when it did not answer)
        self._number = number
        self._on_answer = on_answer

    @property
    def params(self) -> Sequence[object]:
        """`sql`'s parameters, taken now when given as a function (the step's end: its run's
        active time counts to it)."""
        return self._params() if callable(self._params) else self._params

    def read_row(self, row: Sequence[Any]) -> BaseException | None:
        """The ledger's answer: `sql`'s row, or empty when the commit failed (the record is
        buffered; the known number stands and the step is numbered in the background)."""
        stored = NextStep.from_row(row) if row else None
        if stored is not None:
            self.step = stored.step
        return self._on_answer(stored, not row)

    async def read(self) -> BaseException | None:
        """Number the step with its own statement (the ledger could not take it), then read
        the answer as `read_row` does (None from the store: the known number stands)."""
        stored = await self._number()
        if stored is not None:
            self.step = stored.step
        return self._on_answer(stored, False)
