"""A device generates on its own between commands and streams what finishes.

A device actor's calls run one at a time, in the order they were sent. If
generation ran only inside a call (a time slice the driver asks for), the
device would wait for the driver between two slices: a round trip and the
driver's turn over every other device's events. So a Ray device generates
in a thread of its own, slice after slice, while it holds sequences; what
each slice reports waits in an outbox, and the driver's ``poll`` takes it
(waiting for the next slice's when the outbox is empty).

The same thread runs the commands: a call leaves its command in a mailbox
and waits for the answer, and the thread runs what the mailbox holds
between two slices. The device never waits for a command's call to be
handed the device and give it back (a thread woken, the interpreter's lock
passed between threads): the thread goes from a slice to the commands that
came during it to the next slice. One thread also keeps a GPU's per-thread
state (its current device and stream) the same for generation, training and
loads.

Who waits for whom::

    device thread   slice, commands that came during it, slice, ... (never waits while it holds sequences)
    command (call)  waits for its turn in the device thread; returns the outbox so far, then its own result
    poll (call)     waits for the outbox or for no work left (and for a slice still running); returns the outbox

A command's result carries the events generated before it, ahead of its own
(an abort's answer never overtakes the finished sequences that preceded it),
and the calls of one device return in the order they were sent: the driver
sees one device's events in the order they happened.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

# how long a thread that wants the interpreter's lock waits before it asks the holder for it (Python's default
# is 5 ms): the device thread between two slices must not wait that long for a call's thread that is pickling
SWITCH_S = 0.0005


class Generating(Protocol):
    """What the stream needs of a device (``Worker``)."""

    @property
    def has_work(self) -> bool: ...

    def run(self, seconds: float) -> list[Any]: ...


class Stream:
    """Generation and commands in one thread for ``worker``, ``seconds`` a slice (see the module docstring).

    ``_cv`` guards the mailbox, the outbox and the counts; a look waits on
    it, never on a slice. A slice's events join the outbox before the
    thread takes the next command, so a command sees every event before it.
    """

    def __init__(self, worker: Generating, seconds: float) -> None:
        self.worker, self.seconds = worker, seconds
        self._cv = threading.Condition()
        self._mailbox: list[tuple[Callable[[], Any], bool, Future[Any]]] = []
        self._has_work = worker.has_work
        self._slicing = False  # a slice runs: a look waits for its end (a slice that hangs is the look's to time out)
        self.outbox: list[Any] = []
        self.error: BaseException | None = None
        if sys.getswitchinterval() > SWITCH_S:
            sys.setswitchinterval(SWITCH_S)
        self._thread = threading.Thread(target=self._serve, name="device", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        idle = False
        while True:
            with self._cv:
                if idle and not self._mailbox:  # (work the engine did not run last time: look again after a slice)
                    self._cv.wait(self.seconds)
                self._cv.wait_for(lambda: self._mailbox or (self._has_work and self.error is None))
                commands, self._mailbox = self._mailbox, []
                self._slicing = not commands
            if commands:
                for command in commands:
                    self._answer(*command)
                idle = False
                continue
            try:
                events = self.worker.run(self.seconds)
            except BaseException as e:  # (told to the next look and every command after: the device's calls fail)
                with self._cv:
                    self.error, self._slicing = e, False
                    self._cv.notify_all()
                continue
            with self._cv:
                self.outbox += events
                self._has_work, self._slicing = self.worker.has_work, False
                self._cv.notify_all()
            idle = not events

    def _answer(self, fn: Callable[[], Any], with_events: bool, answer: Future[Any]) -> None:
        with self._cv:
            if self.error is not None:
                answer.set_exception(self.error)
                return
            before: list[Any] = []
            if with_events:
                before, self.outbox = self.outbox, []
        try:
            result = fn()
        except BaseException as e:
            with self._cv:  # (the events before it are not lost with the command: the next look takes them)
                self.outbox[:0] = before
                self._has_work = self.worker.has_work
                self._cv.notify_all()
            answer.set_exception(e)
            return
        with self._cv:
            self._has_work = self.worker.has_work
            self._cv.notify_all()
        answer.set_result((before, result) if with_events else result)

    def _send(self, fn: Callable[[], Any], with_events: bool) -> Any:
        answer: Future[Any] = Future()
        with self._cv:
            self._mailbox.append((fn, with_events, answer))
            self._cv.notify_all()
        return answer.result()

    def call(self, fn: Callable[[], T]) -> tuple[list[Any], T]:
        """Run a command between two slices: the events generated before it, and its result."""
        return self._send(fn, True)

    def hold(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` between two slices, leaving the outbox to the next look."""
        return self._send(fn, False)

    def poll(self, timeout: float) -> tuple[list[Any], bool]:
        """What was generated since the last look, waiting up to ``timeout`` for some while the device holds
        work; and whether it still does."""
        with self._cv:
            self._cv.wait_for(lambda: self.outbox or self.error or not self._has_work, timeout)
            # a slice still running is waited for, however long: the driver's bound on this call (device_timeout)
            # is what finds a slice that hangs (an engine stuck in a kernel, an engine process that never answers)
            self._cv.wait_for(lambda: self.outbox or self.error or not self._slicing)
            if self.error is not None:
                raise self.error
            out, self.outbox = self.outbox, []
            return out, self._has_work
