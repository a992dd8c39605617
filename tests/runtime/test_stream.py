"""A device generating on its own between commands: what the driver looks at comes in order, a command goes
between two slices with what came before it, and a slice that fails fails the next look."""

from __future__ import annotations

import threading
import time

import pytest

from pivotrl.runtime.stream import Stream


class FakeDevice:
    """Holds ``left`` sequences; each slice finishes one of them (its number) after ``seconds``."""

    def __init__(self, left: int = 0, fail_at: int = -1) -> None:
        self.left, self.fail_at = left, fail_at
        self.done = 0
        self.log: list[str] = []
        self.inside = threading.Lock()  # held during a slice: a command must never find it taken

    @property
    def has_work(self) -> bool:
        return self.left > 0

    def run(self, seconds: float) -> list[str]:
        with self.inside:
            if self.done == self.fail_at:
                raise RuntimeError("the engine failed")
            time.sleep(seconds)
            self.left -= 1
            self.done += 1
            self.log.append(f"slice {self.done}")
            return [f"finished {self.done}"]

    def command(self, name: str, add: int = 0) -> str:
        assert self.inside.acquire(blocking=False), "a command ran inside a slice"
        self.inside.release()
        self.left += add
        self.log.append(name)
        return name


def wait_for_events(stream: Stream) -> None:
    """Until the device has generated something nobody has looked at (a busy machine may take its time)."""
    deadline = time.monotonic() + 120
    while not stream.outbox:
        assert time.monotonic() < deadline, "the device generated nothing"
        time.sleep(0.01)


def looks(stream: Stream, until: int) -> list[str]:
    out: list[str] = []
    for _ in range(10_000):
        events, has_work = stream.poll(5.0)
        out += events
        if len(out) >= until or not has_work:
            return out
    raise AssertionError("no end")


def test_the_device_generates_without_being_asked_and_looks_take_what_came():
    device = FakeDevice(left=5)
    stream = Stream(device, 0.01)
    got = looks(stream, 5)
    assert got == [f"finished {i}" for i in range(1, 6)]
    assert stream.poll(0.01) == ([], False)  # (nothing held: a look returns at once)


def test_a_command_goes_between_two_slices_with_the_events_before_it():
    device = FakeDevice(left=1000)
    stream = Stream(device, 0.002)
    wait_for_events(stream)  # (slices run meanwhile, nobody looking)
    before, result = stream.call(lambda: device.command("abort", add=-device.left + 3))
    assert result == "abort" and before and before == [f"finished {i}" for i in range(1, len(before) + 1)]
    after = looks(stream, 3)
    assert after == [f"finished {i}" for i in range(len(before) + 1, len(before) + 1 + len(after))]
    assert device.log.index("abort") == len(before)  # in the order it happened


def test_work_given_to_an_idle_device_is_generated():
    device = FakeDevice()
    stream = Stream(device, 0.001)
    assert stream.poll(0.01) == ([], False)
    before, _ = stream.call(lambda: device.command("generate", add=2))
    assert before == [] and looks(stream, 2) == ["finished 1", "finished 2"]


def test_a_failed_slice_fails_the_next_look_and_the_next_command():
    device = FakeDevice(left=5, fail_at=2)
    stream = Stream(device, 0.001)
    with pytest.raises(RuntimeError, match="the engine failed"):
        looks(stream, 5)
    with pytest.raises(RuntimeError, match="the engine failed"):
        stream.call(lambda: device.command("abort"))


def test_a_look_waits_for_a_slice_that_hangs_so_the_drivers_bound_finds_it():
    """A slice stuck in the engine: a look does not come back empty (each new look would get a new deadline and
    the device would never be taken for lost); it waits for the slice, and the driver's bound ends the wait."""
    release = threading.Event()

    class Stuck(FakeDevice):
        def run(self, seconds: float) -> list[str]:
            release.wait()
            return super().run(seconds)

    stream = Stream(Stuck(left=1), 0.001)
    answered: list[object] = []
    look = threading.Thread(target=lambda: answered.append(stream.poll(0.01)), daemon=True)
    look.start()
    look.join(0.3)
    assert look.is_alive() and not answered  # (past its own timeout: the slice still runs)
    release.set()
    look.join(120.0)  # (returns as soon as the look does)
    assert answered == [(["finished 1"], False)]


def test_a_command_that_fails_leaves_the_events_before_it_to_the_next_look():
    device = FakeDevice(left=2)
    stream = Stream(device, 0.001)
    wait_for_events(stream)

    def fail() -> None:
        raise ValueError("a member is lost")

    with pytest.raises(ValueError):
        stream.call(fail)
    assert looks(stream, 2) == ["finished 1", "finished 2"]


def test_commands_run_in_the_thread_that_generates_and_a_hold_leaves_the_events_to_the_look():
    """One thread for slices and commands: the device never waits for a call's thread to be handed the device
    (and a GPU's per-thread state is the same for both)."""
    threads: set[str] = set()

    class Watched(FakeDevice):
        def run(self, seconds: float) -> list[str]:
            threads.add(threading.current_thread().name)
            return super().run(seconds)

    device = Watched(left=3)
    stream = Stream(device, 0.001)
    wait_for_events(stream)
    assert stream.hold(lambda: threading.current_thread().name) in threads
    before, name = stream.call(lambda: threading.current_thread().name)
    assert name in threads and len(threads) == 1 and name != threading.current_thread().name
    assert before  # (the events the hold left)
