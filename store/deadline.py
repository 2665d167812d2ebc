"""Client calls with a deadline: for store clients that have no timeout of their own.

`DeadlineWorkers.call(fn, deadline_s)` runs ``fn`` on a worker thread and waits for it
at most ``deadline_s`` seconds. A call that misses its deadline is abandoned, not
killed: it keeps its worker thread until the client returns, and then runs the call's
``on_late`` cleanup (so a buffer the client may still write into is handed back only
once the client is done with it). Workers are reused; at most ``max_workers`` exist, so
a store that stops answering costs a bounded number of parked threads, and a call that
finds all of them parked fails at once instead of queueing behind them.

The client must release the GIL while it waits (Mooncake's batch calls do), or no
deadline can be kept from Python.
"""
from __future__ import annotations

import enum
import queue
import threading
from typing import Callable, List, Optional, Tuple


class Outcome(enum.Enum):
    DONE = "done"           # fn returned (its value) or raised (the exception)
    LATE = "late"           # the deadline passed; fn goes on in the background
    BUSY = "busy"           # every worker is parked on an unanswered call


class _Job:
    __slots__ = ("fn", "on_late", "keep", "done", "lock", "finished", "abandoned", "value", "error")

    def __init__(self, fn: Callable[[], object], on_late: Optional[Callable[[], None]], keep):
        self.fn = fn
        self.on_late = on_late
        self.keep = keep
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.finished = False
        self.abandoned = False
        self.value = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:      # handed to the caller, never lost in the thread
            self.error = e
        with self.lock:
            self.finished = True
            late = self.abandoned
        self.done.set()
        if late and self.on_late is not None:
            try:
                self.on_late()
            except Exception:
                pass
        self.fn = self.on_late = self.keep = None


class DeadlineWorkers:
    """A small set of reusable worker threads running calls with a deadline."""

    def __init__(self, name: str, max_workers: int = 16):
        self.name = name
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._idle: List[queue.SimpleQueue] = []
        self._count = 0
        self._running = 0
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Calls running now, abandoned ones included."""
        with self._lock:
            return self._running

    def call(self, fn: Callable[[], object], deadline_s: float,
             on_late: Optional[Callable[[], None]] = None, keep=None) -> Tuple[Outcome, object]:
        """(DONE, value), (LATE, None) or (BUSY, None); an exception ``fn`` raised is
        raised here. ``keep`` (e.g. the buffers the client reads or writes) stays
        referenced until ``fn`` has returned, even when the caller has gone."""
        job = _Job(fn, on_late, keep)
        inbox = self._take()
        if inbox is None:
            return Outcome.BUSY, None
        inbox.put(job)
        if not job.done.wait(deadline_s):
            with job.lock:
                if not job.finished:
                    job.abandoned = True
                    return Outcome.LATE, None
        if job.error is not None:
            raise job.error
        return Outcome.DONE, job.value

    def close(self) -> None:
        """Stop the idle workers; parked ones stop when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)

    # ------------------------------------------------------------------ workers
    def _take(self) -> Optional[queue.SimpleQueue]:
        with self._lock:
            if self._closed:
                return None
            self._running += 1
            if self._idle:
                return self._idle.pop()
            if self._count >= self.max_workers:
                self._running -= 1
                return None
            self._count += 1
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                         name=f"{self.name}-{self._count}").start()
        return inbox

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            job = inbox.get()
            if job is None:
                break
            job.run()
            with self._lock:
                self._running -= 1
                if self._closed:
                    break
                self._idle.append(inbox)
        with self._lock:
            self._count -= 1
