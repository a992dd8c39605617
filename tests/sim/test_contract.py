"""Contract: the simulator answers the control plane's commands as the real runtime does.

One script of commands (shift to rollout, generate and run slices to the end,
shift to the judge, judge, abort one sequence of a generation mid-way and then
the rest, train: accumulate and step) goes to a real ``Worker`` behind the ``LocalDriver`` (tiny checkpoints)
and to a ``SimDriver``. Both must answer with the same event kinds in the same
order; only how many slices a generation takes may differ, and the messages
must have the same shapes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.control.messages import (
    Abort,
    Aborted,
    Accumulate,
    Event,
    Generate,
    Generated,
    GenParams,
    GenRequest,
    GenResult,
    Judge,
    Judged,
    JudgeRequest,
    JudgeResult,
    Progress,
    Role,
    Shift,
    ShiftDone,
    Step,
    Trained,
    TrainShard,
)
from pivotrl.gps import LocalStore
from pivotrl.resolve import Hardware, resolve
from pivotrl.runtime.contexts import ContextSpec
from pivotrl.runtime.job import publish_initial
from pivotrl.runtime.local import LocalDriver
from pivotrl.runtime.worker import TrainSpec, Worker
from pivotrl.sim.driver import SimDriver
from pivotrl.sim.run import build
from tests.conftest import planned

SHORT = GenParams(max_new_tokens=6, temperature=1.0)
LONG = GenParams(max_new_tokens=120, temperature=0.0)
JUDGE = GenParams(max_new_tokens=8, temperature=0.0)


def real_driver(ckpt: dict[str, Path]) -> LocalDriver:
    cfg = load_config(None, [f"policy.path={ckpt['policy']}", f"judge.path={ckpt['judge']}"])
    store = LocalStore()
    plan = resolve(cfg, Hardware("cpu"))
    publish_initial(store, cfg, plan)
    spec = ContextSpec(max_len=160, judge_max_len=160, judge_template="{question}|{reference}|{response}|")
    worker = Worker(0, store, spec, TrainSpec(planned(), 1.0), origin=time.time())
    return LocalDriver([worker], slice_seconds=0.002)


def sim_driver() -> SimDriver:
    cfg = load_config(
        None,
        [
            "sim.gpus=1",
            "sim.lengths.kind=fixed",
            "sim.lengths.value=100",
            "sim.slice_s=0.05",
            "sim.prompt_len=8",
            "train.backend=replicated",
        ],  # (the real worker's, on this CPU: each group backpropagated as it comes)
    )
    return SimDriver(build(cfg).spec)


def kinds(events: list[Event]) -> tuple[str, ...]:
    return tuple(type(e).__name__ for e in events)


def run_generation(driver, results_kind: type) -> tuple[list[tuple[str, ...]], list, list[Progress]]:
    """Slices until nothing is in flight: each must be a Progress, then maybe the finished results."""
    calls, results, progress = [], [], []
    for _ in range(10_000):
        events = driver.next_events()
        calls.append(kinds(events))
        assert isinstance(events[0], Progress) and events[0].seconds >= 0
        assert all(isinstance(e, results_kind) for e in events[1:]) and len(events) <= 2
        progress.append(events[0])
        results += [r for e in events[1:] for r in e.results]
        if len(results) == 3:
            return calls, sorted(results, key=lambda r: r.uid), progress
    raise AssertionError("generation did not finish")


def script(driver) -> tuple[list[str], dict[str, object]]:
    """The command script; returns the normalised answer and the messages to compare shapes."""
    trace: list[str] = []
    seen: dict[str, object] = {}

    def one(cmd) -> list[Event]:
        driver.submit(cmd)
        events = driver.next_events()
        trace.append(",".join(kinds(events)))
        return events

    [done] = one(Shift(0, Role.ROLLOUT, 0))
    seen["shift"] = done
    reqs = tuple(GenRequest(uid, f"{uid}+{uid}=", seed=7 + uid, params=SHORT) for uid in range(3))
    driver.submit(Generate(0, reqs, 0))
    calls, gen, progress = run_generation(driver, Generated)
    trace.append(f"slices({len(calls) > 0})->Generated")
    seen["gen"], seen["gen_progress"] = gen, progress
    one(Shift(0, Role.JUDGE, 0))
    judge = tuple(JudgeRequest(r.uid, f"{r.uid}+{r.uid}", str(2 * r.uid), r.text, 7 + r.uid, JUDGE) for r in gen)
    driver.submit(Judge(0, judge))
    calls, judged, progress = run_generation(driver, Judged)
    trace.append(f"slices({len(calls) > 0})->Judged")
    seen["judged"], seen["judge_progress"] = judged, progress
    one(Shift(0, Role.ROLLOUT, 0))
    long = tuple(GenRequest(10 + i, f"{i}+{i}=", seed=20 + i, params=LONG) for i in range(2))
    driver.submit(Generate(0, long, 0))
    first = driver.next_events()  # one slice, then the abort mid-generation
    assert kinds(first)[0] == "Progress"
    [part] = one(Abort(0, (10,)))  # rebalancing: one sequence moves, the other runs on
    seen["partial"] = part
    [aborted] = one(Abort(0))
    seen["aborted"] = aborted
    one(Shift(0, Role.TRAIN, 0))
    shard = TrainShard(
        tuple(tuple(r.prompt_ids) for r in gen),
        tuple(tuple(r.output_ids) for r in gen),
        tuple(tuple(r.logprobs) for r in gen),
        (1.0, -0.5, -0.5),
    )
    [acc] = one(Accumulate(0, 0, shard))
    seen["accumulated"] = acc
    [trained] = one(Step((0,), 0, sum(len(r.output_ids) for r in gen)))
    seen["trained"] = trained
    return trace, seen


@pytest.fixture(scope="module")
def answers(tiny_checkpoints):
    return script(real_driver(tiny_checkpoints)), script(sim_driver())


def test_same_event_kinds_in_the_same_order(answers):
    (real, _), (sim, _) = answers
    want = ["ShiftDone", "slices(True)->Generated", "ShiftDone", "slices(True)->Judged", "ShiftDone", "Aborted",
            "Aborted", "ShiftDone", "Accumulated", "Trained"]  # fmt: skip
    assert real == want and sim == want


def test_messages_have_the_same_shapes(answers):
    for _, seen in answers:
        shift = seen["shift"]
        assert isinstance(shift, ShiftDone) and (shift.device, shift.role, shift.version) == (0, Role.ROLLOUT, 0)
        assert shift.seconds > 0 and shift.nbytes > 0
        for r in seen["gen"]:
            assert isinstance(r, GenResult) and r.version == 0 and r.finish_reason in ("stop", "length")
            assert r.prompt_ids and 1 <= len(r.output_ids) <= SHORT.max_new_tokens == 6
            assert len(r.logprobs) == len(r.output_ids) and all(isinstance(t, int) for t in r.output_ids)
            assert r.finish_reason == "stop" or len(r.output_ids) == SHORT.max_new_tokens
        for j in seen["judged"]:
            assert isinstance(j, JudgeResult) and 1 <= j.tokens <= JUDGE.max_new_tokens
        # both count the context their decode steps read: at least the prompt, for every token decoded
        for key, results in (("gen_progress", seen["gen"]), ("judge_progress", seen["judged"])):
            slices = seen[key]
            decoded = sum(p.tokens for p in slices) - len(results)  # the first token of each: its prefill
            assert sum(p.steps for p in slices) > 0 and decoded > 0
            assert sum(p.kv_tokens for p in slices) > decoded
            assert not j.truncated or j.tokens == JUDGE.max_new_tokens
        part, aborted = seen["partial"], seen["aborted"]
        assert isinstance(part, Aborted) and part.device == 0 and not part.judge
        assert isinstance(aborted, Aborted) and aborted.device == 0 and not aborted.judge
        assert [r.uid for r in part.gen] == [10] and [r.uid for r in aborted.gen] == [11]
        for r in (*part.gen, *aborted.gen):  # resumable: the prompt as encoded, the tokens and log-probs so far
            assert r.prompt_ids and 1 <= len(r.output_ids) < LONG.max_new_tokens
            assert len(r.logprobs) == len(r.output_ids) and r.params == LONG and r.seed in (20, 21)
        acc = seen["accumulated"]
        # the tokens through the forward and backward: prompts and responses (the loss sees the responses)
        processed = sum(len(r.prompt_ids) + len(r.output_ids) for r in seen["gen"])
        assert (acc.device, acc.samples) == (0, 3) and acc.tokens == processed
        assert acc.seconds > 0
        trained = seen["trained"]
        assert isinstance(trained, Trained) and (trained.devices, trained.version) == ((0,), 1)
        assert trained.stats["tokens"] == sum(len(r.output_ids) for r in seen["gen"]) and trained.seconds > 0
