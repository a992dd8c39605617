"""A device generates on its own between commands and streams what finishes.

A device actor's calls run one at a time, in the order they were sent. If
generation ran only inside a call (a time slice the driver asks for), the
device would wait for the driver between two slices: a round trip and the
driver's turn over every other device's events. So a Ray device generates
in a thread of its own, slice after slice, while it holds sequences; what
each slice reports waits in an outbox, and the driver's ``poll`` takes it
(waiting for the next slice's when the outbox is empty).

Who waits for whom::

    generation thread   slice, slice, ... (each holding the device; between two, a command waiting goes first)
    command (a call)    holds the device between two slices; returns the outbox so far, then its own result
    poll (a call)       waits for the outbox or for no work left (never for a slice); returns the outbox

A command's result carries the events generated before it, ahead of its own
(an abort's answer never overtakes the finished sequences that preceded it),
and the calls of one device return in the order they were sent: the driver
sees one device's events in the order they happened.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Generating(Protocol):
    """What the stream needs of a device (``Worker``)."""

    @property
    def has_work(self) -> bool: ...

    def run(self, seconds: float) -> list[Any]: ...


class Stream:
    """Generation in its own thread for ``worker``, ``seconds`` a slice (see the module docstring).

    Two locks: ``_device`` over the worker (a slice, or a command), and
    ``_cv`` over the outbox and the counts (a look waits on it, never on a
    slice). A slice's events join the outbox before the device is let go, so
    a command never sees the device after a slice whose events it has not.
    """

    def __init__(self, worker: Generating, seconds: float) -> None:
        self.worker, self.seconds = worker, seconds
        self._device = threading.Lock()
        self._cv = threading.Condition()
        self._asking = 0  # commands waiting for the device: the generation thread lets them go first
        self._has_work = worker.has_work
        self._slicing = False  # a slice runs: a look waits for its end (a slice that hangs is the look's to time out)
        self.outbox: list[Any] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._generate, name="generate", daemon=True)
        self._thread.start()

    def _generate(self) -> None:
        idle = False
        while True:
            with self._cv:
                if idle:  # (work the engine did not run last time: look again after a slice, or when told)
                    self._cv.wait(self.seconds)
                self._cv.wait_for(lambda: not self._asking and self._has_work)
            with self._device:
                if self._asking:  # (a command came in between: it goes first)
                    idle = False
                    continue
                with self._cv:
                    self._slicing = True
                try:
                    events = self.worker.run(self.seconds)
                except BaseException as e:  # (told to the next look or command: the device's call fails with it)
                    with self._cv:
                        self.error, self._slicing = e, False
                        self._cv.notify_all()
                    return
                with self._cv:
                    self.outbox += events
                    self._has_work, self._slicing = self.worker.has_work, False
                    self._cv.notify_all()
            idle = not events

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the device between two slices (the generation thread waits until the holder is done)."""
        with self._cv:
            self._asking += 1
        try:
            with self._device:
                try:
                    yield
                finally:
                    with self._cv:
                        self._has_work = self.worker.has_work
        finally:
            with self._cv:
                self._asking -= 1
                self._cv.notify_all()

    def call(self, fn: Callable[[], T]) -> tuple[list[Any], T]:
        """Run a command between two slices: the events generated before it, and its result."""
        with self.locked():
            with self._cv:
                self._raise()
                before, self.outbox = self.outbox, []
            try:
                return before, fn()
            except BaseException:
                with self._cv:  # (the events before it are not lost with the command: the next look takes them)
                    self.outbox[:0] = before
                raise

    def poll(self, timeout: float) -> tuple[list[Any], bool]:
        """What was generated since the last look, waiting up to ``timeout`` for some while the device holds
        work; and whether it still does."""
        with self._cv:
            self._cv.wait_for(lambda: self.outbox or self.error or not self._has_work, timeout)
            # a slice still running is waited for, however long: the driver's bound on this call (device_timeout)
            # is what finds a slice that hangs (an engine stuck in a kernel, an engine process that never answers)
            self._cv.wait_for(lambda: self.outbox or self.error or not self._slicing)
            self._raise()
            out, self.outbox = self.outbox, []
            return out, self._has_work

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error
