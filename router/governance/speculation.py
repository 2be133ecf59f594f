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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["SPECULATE_WITHIN_S", "Speculation"]

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
