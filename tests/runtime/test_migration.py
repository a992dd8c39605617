"""Migration: a sequence aborted on one device and resumed on another yields the
tokens it would have yielded without the move (counter-based sampling)."""

import pytest
import torch

from pivotrl.control.messages import Generate, Generated, GenParams, GenRequest, Role
from pivotrl.control.modes import StaticPolicy
from pivotrl.gps import LocalStore
from pivotrl.model import char_tokenizer
from pivotrl.runtime.contexts import ContextSpec, publish_checkpoint
from pivotrl.runtime.worker import TrainSpec, Worker
from tests.conftest import planned, tiny_model

PARAMS = GenParams(max_new_tokens=24, temperature=1.0)


@pytest.fixture(scope="module")
def store():
    s = LocalStore()
    publish_checkpoint(s, "policy", 0, tiny_model("Qwen2ForCausalLM", 0), char_tokenizer())
    return s


def worker(store, device):
    torch.manual_seed(0)
    w = Worker(device, store, ContextSpec(max_batch=8), TrainSpec(planned(), 1.0), origin=0.0)
    w.shift(Role.ROLLOUT, 0)
    return w


def requests(n=16):
    return tuple(GenRequest(uid, f"{uid:02d}+{uid * 3:02d}=", 1000 + uid, PARAMS) for uid in range(n))


def drain(w):
    out = {}
    while w.has_work:
        for e in w.run(1.0):
            if isinstance(e, Generated):
                out.update({r.uid: r for r in e.results})
    return out


def test_aborted_sequences_resume_elsewhere_with_identical_tokens(store):
    ref = worker(store, 9)
    ref.generate(Generate(9, requests(), 0))
    expected = drain(ref)

    a, b = worker(store, 0), worker(store, 1)
    a.generate(Generate(0, requests(), 0))
    done = {}
    for _ in range(6):  # a few engine steps on device 0 only
        for e in a.run(0.0):
            if isinstance(e, Generated):
                done.update({r.uid: r for r in e.results})
    aborted = a.abort()
    assert not a.has_work and not aborted.judge
    moved = aborted.gen
    assert moved and any(0 < len(r.output_ids) < PARAMS.max_new_tokens for r in moved)  # really mid-generation
    assert len(done) + len(moved) == len(requests())
    b.generate(Generate(1, moved, 0))
    done.update(drain(b))
    assert set(done) == set(expected)
    for uid, r in expected.items():
        assert done[uid].output_ids == r.output_ids, uid
        assert done[uid].logprobs == pytest.approx(r.logprobs, abs=1e-5)
        assert done[uid].finish_reason == r.finish_reason


def test_abort_twice_and_back(store):
    """Moved back and forth between devices, still the same tokens."""
    ref = worker(store, 9)
    ref.generate(Generate(9, requests(8), 0))
    expected = drain(ref)
    a, b = worker(store, 0), worker(store, 1)
    a.generate(Generate(0, requests(8), 0))
    done = {}
    for hop in range(4):
        src, dst = (a, b) if hop % 2 == 0 else (b, a)
        for _ in range(3):
            for e in src.run(0.0):
                if isinstance(e, Generated):
                    done.update({r.uid: r for r in e.results})
        moved = src.abort().gen
        if moved:
            dst.generate(Generate(dst.device, moved, 0))
    done.update(drain(a))
    done.update(drain(b))
    assert {u: r.output_ids for u, r in done.items()} == {u: r.output_ids for u, r in expected.items()}


class LeaveMidRollout(StaticPolicy):
    """Two devices generate; once some responses of a step are in and device 0 still has
    sequences in flight, device 0 leaves for the judge role, so they migrate to device 1.
    Device 0 trains."""

    name, devices, preempt = "scripted", 2, True

    def __init__(self) -> None:
        self.most = 0  # the most generation work seen pending in this step

    def targets(self, demand):
        if demand.gen_pending:
            self.most = max(self.most, demand.gen_pending)
            leave = demand.gen_pending < self.most and demand.loads[0] > 0
            return {0: Role.JUDGE if leave else Role.ROLLOUT, 1: Role.ROLLOUT}
        self.most = 0
        if demand.judge_pending:
            return {0: Role.JUDGE, 1: Role.JUDGE}
        return {0: Role.TRAIN, 1: Role.ROLLOUT}

    def train_devices(self):
        return (0,)


def test_job_with_forced_migrations_matches_the_unmigrated_run(tiny_checkpoints, tmp_path, monkeypatch):
    import json

    monkeypatch.setattr("pivotrl.runtime.local.SLICE_SECONDS", 0.0)  # one engine step per look: migrate mid-way
    from pivotrl.runtime.job import run_job
    from tests.runtime.test_job import small_job

    args = ("steps=2", "eval.every=1", "rollout.max_batch=3", "rollout.prompts_per_step=6")
    run_job(small_job(tiny_checkpoints, *args), tmp_path / "plain", progress=False)
    cfg = small_job(tiny_checkpoints, *args, "devices=2")
    summary = run_job(cfg, tmp_path / "moved", progress=False, policy=LeaveMidRollout(), in_process=True)
    assert summary["migrations"] > 0
    plain, moved = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                    for d in ("plain", "moved"))  # fmt: skip
    for a, b in zip(plain, moved, strict=True):
        for key in ("reward_mean", "response_tokens", "judge_tokens", "accuracy", "heldout_accuracy"):
            assert a[key] == b[key], key
        assert b["train_grad_norm"] == pytest.approx(a["train_grad_norm"], rel=1e-5)
    events = [json.loads(x) for x in (tmp_path / "moved" / "events.jsonl").read_text().splitlines()]
    assert any(e["role"] == "migrate" for e in events)


def test_a_judgment_moved_mid_way_resumes_with_identical_text():
    from pivotrl.control.messages import Judge, Judged, JudgeRequest

    s = LocalStore()
    publish_checkpoint(s, "judge", 0, tiny_model("LlamaForCausalLM", 1), char_tokenizer())
    spec = ContextSpec(max_batch=8, judge_template="Q:{question}\nR:{reference}\nA:{response}\nJ:")

    def judge_worker(device):
        w = Worker(device, s, spec, TrainSpec(planned(), 1.0), origin=0.0)
        w.shift(Role.JUDGE, 0)
        return w

    reqs = tuple(JudgeRequest(u, f"{u:02d}+11=", str(u + 11), str(u + 10), 7 + u, GenParams(20, 0.0)) for u in range(6))

    def texts(events):
        return {r.uid: r.text for e in events if isinstance(e, Judged) for r in e.results}

    ref = judge_worker(9)
    ref.judge(Judge(9, reqs))
    expected = {}
    while ref.has_work:
        expected |= texts(ref.run(1.0))
    a, b = judge_worker(0), judge_worker(1)
    a.judge(Judge(0, reqs))
    got = texts(a.run(0.0)) | texts(a.run(0.0))
    moved = a.abort().judge
    assert moved and all(r.prompt_ids and 0 < len(r.output_ids) < 20 for r in moved)
    b.judge(Judge(1, moved))
    while b.has_work:
        got |= texts(b.run(1.0))
    assert got == expected
