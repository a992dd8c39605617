"""Engines in processes of their own: the client's bookkeeping, the GPU share of each process, and the rule
that a vLLM engine with sleep mode is alone in its process."""

from __future__ import annotations

from typing import Any

import pytest

from pivotrl.engine import vllm_engine
from pivotrl.engine.engine import EngineStats, SamplingParams, SeqState
from pivotrl.engine.protocol import SliceReport
from pivotrl.runtime.devices import process_share
from pivotrl.runtime.engine_host import EngineClient, Opened, engine_processes, needs_process


class FakeHost:
    """Answers an EngineClient's calls as an engine's process would, and records them."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.held: dict[int, SeqState] = {}

    def __call__(self, method: str, *args: Any) -> Any:
        self.calls.append(method)
        if method == "open":
            return Opened(10, None, 4, 64, ("policy",), 123)
        if method == "add":
            for s in args[0]:
                if s.uid in self.held:
                    raise ValueError(f"sequence {s.uid} is already in this engine")
                self.held[s.uid] = s
            return None
        if method == "abort":
            return [self.held.pop(u) for u in args[0]]
        if method == "abort_all":
            out, self.held = list(self.held.values()), {}
            return out
        if method == "run":  # the lowest uid finishes
            uid = min(self.held)
            return SliceReport(finished=[self.held.pop(uid)], running=len(self.held) + 1), EngineStats()
        return None


def state(uid: int) -> SeqState:
    return SeqState(uid, [1, 2], seed=uid, params=SamplingParams(4))


def test_the_client_mirrors_what_its_engine_holds():
    host = FakeHost()
    client = EngineClient("policy", host, host)
    opened = client.open(0)
    assert (client.max_batch, client.max_len, opened.builds, opened.pid) == (4, 64, ("policy",), 123)
    for uid in (3, 1, 2):
        client.add(state(uid))
    assert client.has_work and client.load == 3
    with pytest.raises(ValueError, match="already"):
        client.add(state(1))
    report = client.run(0.05, lambda: 0.0)
    assert [s.uid for s in report.finished] == [1] and client.load == 2
    assert client.abort(3).uid == 3 and client.load == 1
    with pytest.raises(KeyError, match="not in this engine"):
        client.abort(3)
    assert [s.uid for s in client.abort_all()] == [2] and not client.has_work
    with pytest.raises(RuntimeError, match="loads its weights from the GPS itself"):
        client.load_weights(None)


def test_adds_are_sent_and_the_next_call_waits_behind_them():
    sent: list[str] = []
    host = FakeHost()

    def send(method: str, *args: Any) -> None:
        sent.append(method)
        host(method, *args)

    client = EngineClient("judge", host, send)
    client.open(0)
    client.add(state(5))
    assert sent == ["add"] and host.calls == ["open", "add"]


@pytest.mark.parametrize(
    ("name", "gpus", "processes", "share"),
    [
        ("one GPU, trainer alone", 1.0, 1, 1.0),
        ("one GPU, trainer and two engines", 1.0, 3, 0.3333),
        ("half a GPU, trainer and two engines", 0.5, 3, 0.1666),
        ("a share that is not a multiple of the resolution", 0.3, 1, 0.3),
        ("a quarter, trainer and one engine", 0.25, 2, 0.125),
    ],
)
def test_a_device_s_processes_split_its_gpu_share(name, gpus, processes, share):
    assert process_share(gpus, processes) == share
    assert process_share(gpus, processes) * processes <= gpus


def test_vllm_engines_have_processes_of_their_own_and_native_ones_not(monkeypatch):
    assert needs_process("vllm") and not needs_process("native") and not needs_process("auto")
    assert engine_processes("native", "native", "cuda") == 1
    assert engine_processes("vllm", "native", "cpu") == 2
    assert engine_processes("vllm", "vllm", "cpu") == 3
    monkeypatch.setattr(vllm_engine, "available", lambda: True)
    assert engine_processes("auto", "auto", "cuda") == 3  # (auto may resolve to vLLM there: its share is kept)
    assert engine_processes("auto", "auto", "cpu") == 1
    monkeypatch.setattr(vllm_engine, "available", lambda: False)
    assert engine_processes("auto", "vllm", "cuda") == 2


def test_an_engine_with_sleep_mode_is_alone_in_its_process(monkeypatch):
    monkeypatch.setattr(vllm_engine, "_live", {})
    vllm_engine._check_alone(True)  # the first: alone
    monkeypatch.setattr(vllm_engine, "_live", {0: True})
    with pytest.raises(RuntimeError, match="alone in its process"):
        vllm_engine._check_alone(False)
    monkeypatch.setattr(vllm_engine, "_live", {0: False})
    with pytest.raises(RuntimeError, match="alone in its process"):
        vllm_engine._check_alone(True)
    vllm_engine._check_alone(False)  # two engines without sleep mode (a CPU) may share one


def test_a_dead_engine_process_ends_its_devices_process(monkeypatch):
    """The device's process exits (the driver takes the device for lost and starts it again, with new engines)
    instead of raising an error the driver would take for the device's own, ending the run."""
    import ray
    from ray.exceptions import ActorDiedError

    from pivotrl.runtime import engine_host

    class _Method:
        def remote(self, *args):
            return "ref"

    class _Actor:
        def __getattr__(self, name):
            return _Method()

    def dead(refs, *a, **k):
        raise ActorDiedError()

    exits = []

    def exit_(status: int) -> None:
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(ray, "get", dead)
    monkeypatch.setattr(engine_host.os, "_exit", exit_)
    client = engine_host.ray_client(_Actor(), "judge")
    with pytest.raises(SystemExit):
        client.open(0)
    assert exits == [engine_host.ENGINE_DIED]
