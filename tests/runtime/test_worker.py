"""One device over a LocalStore: shifts between roles, version checks, the train role's publish.

Tiny random models (tests.conftest.tiny_model); no Ray, no process group (one train device).
"""

from __future__ import annotations

import gc
import time
import weakref
from dataclasses import replace

import pytest
import torch

from pivotrl.config import load_config
from pivotrl.control.messages import (
    Accumulate,
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
    Step,
    Trained,
    TrainShard,
)
from pivotrl.engine.kv_budget import KVBudgetError, bytes_per_token
from pivotrl.gps import Kind, LocalStore, VersionError, module_tensors, publish_optimizer
from pivotrl.model import char_tokenizer
from pivotrl.resolve import Hardware, Plan, resolve
from pivotrl.runtime.contexts import JUDGE, POLICY, ContextSpec, GenerationContext, TrainContext, publish_checkpoint
from pivotrl.runtime.worker import TrainSpec, Worker, WrongVersionError
from pivotrl.train.config import TrainConfig
from pivotrl.train.grpo import GRPOTrainer
from pivotrl.train.traits import TrainerKind
from tests.conftest import planned, tiny_model

SPEC = ContextSpec(judge_template="Q:{question}\nR:{reference}\nA:{response}\nJ:")
GREEDY = GenParams(max_new_tokens=6, temperature=0.0)
SAMPLED = GenParams(max_new_tokens=6, temperature=1.0)
CONTEXT_TYPE = {Role.ROLLOUT: GenerationContext, Role.JUDGE: GenerationContext, Role.TRAIN: TrainContext}


def train(w: Worker, device: int, version: int, shard: TrainShard, tokens: int):
    """One update on one device: the backward of the shard, then the optimizer step."""
    w.accumulate(Accumulate(device, version, shard))
    return w.step(Step((device,), version, tokens), 0, ("127.0.0.1", 0))  # a group of one, met anew


def label(role: Role | None) -> str:
    return role.value if role else "none"


@pytest.fixture
def store() -> LocalStore:
    """Policy v0 and v1 (different weights), the judge, and optimizer state for v1 (none for v0)."""
    store = LocalStore()
    tok = char_tokenizer()
    publish_checkpoint(store, POLICY, 0, tiny_model(seed=0), tok)
    v1 = tiny_model(seed=2)
    publish_checkpoint(store, POLICY, 1, v1, tok)
    publish_checkpoint(store, JUDGE, 0, tiny_model("LlamaForCausalLM", seed=1), tok)
    opt = GRPOTrainer(v1, TrainConfig()).optimizer
    for p in v1.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    publish_optimizer(store, POLICY, 1, opt, v1)
    return store


def make_worker(store: LocalStore, device: int = 0) -> Worker:
    return Worker(device, store, SPEC, TrainSpec(planned(), 1.0), origin=time.time())


def gen_requests(n: int, params: GenParams = GREEDY) -> tuple[GenRequest, ...]:
    return tuple(GenRequest(uid, f"{uid}+{uid}=", seed=100 + uid, params=params) for uid in range(n))


def judge_requests(n: int) -> tuple[JudgeRequest, ...]:
    return tuple(
        JudgeRequest(uid, f"{uid}+1", str(uid + 1), f"it is {uid}", seed=uid, params=GREEDY) for uid in range(n)
    )


def drain(worker: Worker) -> list[GenResult | JudgeResult]:
    """Run the worker until nothing is in flight; every finished sequence, in uid order."""
    out: list = []
    prefilled = 0
    for _ in range(1000):
        if not worker.has_work:
            assert prefilled > 0  # the prompts' prefill was timed apart (it prices a migration)
            return sorted(out, key=lambda r: r.uid)
        progress, *finished = worker.run(10.0)
        assert isinstance(progress, Progress) and progress.device == worker.device and progress.seconds > 0
        assert 0 <= progress.prefill_seconds <= progress.seconds
        prefilled += progress.prefill_tokens
        for event in finished:
            assert isinstance(event, Generated | Judged) and event.device == worker.device
            out += event.results
    raise AssertionError("worker did not drain")


def loaded_bytes(store: LocalStore, role: Role, version: int) -> int:
    """What a fresh context of ``role`` at ``version`` brings onto the device."""
    if role is Role.JUDGE:
        return store.fetch(JUDGE, 0).nbytes
    nbytes = store.fetch(POLICY, version).nbytes
    if role is Role.TRAIN and version in store.versions(POLICY, Kind.OPTIMIZER):
        nbytes += store.fetch(POLICY, version, Kind.OPTIMIZER).nbytes
    return nbytes


def assert_holds(model: torch.nn.Module, store: LocalStore, name: str, version: int) -> None:
    stored = store.fetch(name, version).tensors
    live = module_tensors(model)
    assert live.keys() == stored.keys()
    assert all(torch.equal(live[k], stored[k]) for k in stored), f"model does not hold {name} v{version}"


def model_of(ctx: GenerationContext | TrainContext) -> torch.nn.Module:
    """The model a context holds: its engine's, or its trainer's."""
    return ctx.trainer.model if isinstance(ctx, TrainContext) else ctx.model


def adam_steps(ctx: TrainContext) -> list[float]:
    opt = ctx.trainer.replica.trainer.optimizer
    return [float(opt.state[p]["step"]) for g in opt.param_groups for p in g["params"] if p in opt.state]


# -- shifts -------------------------------------------------------------------------

SHIFT_CASES = [
    pytest.param(before, after, id=f"{label(before)}->{label(after)}")
    for before in (None, Role.ROLLOUT, Role.JUDGE, Role.TRAIN)
    for after in (Role.ROLLOUT, Role.JUDGE, Role.TRAIN)
]


@pytest.mark.parametrize(("before", "after"), SHIFT_CASES)
def test_shift_loads_the_role_at_its_version(store, before, after):
    w = make_worker(store)
    if before is not None:
        w.shift(before, 0)
    old = w.ctx
    w.drain_slices()

    done = w.shift(after, 1)

    assert (done.device, done.role, done.version) == (0, after, 1)
    assert w.role is after and type(w.ctx) is CONTEXT_TYPE[after]
    if after is Role.JUDGE:  # the judge is frozen: the requested version does not apply to it
        assert w.ctx.name == JUDGE and w.ctx.version == 0
        assert_holds(w.ctx.model, store, JUDGE, 0)
    else:
        assert w.ctx.version == 1
        assert_holds(model_of(w.ctx), store, POLICY, 1)
    if before is after is Role.JUDGE:  # nothing to load: same judge, same engine
        assert w.ctx is old and done.nbytes == 0 and done.seconds >= 0
    elif before is after is Role.ROLLOUT:  # new weights into the same engine
        assert w.ctx is old and done.nbytes == store.fetch(POLICY, 1).nbytes and done.seconds > 0
    else:
        assert w.ctx is not old and done.nbytes == loaded_bytes(store, after, 1) and done.seconds > 0
    if after is Role.TRAIN:  # v1 has optimizer state in the GPS: the new train context restores it
        assert adam_steps(w.ctx) and set(adam_steps(w.ctx)) == {1.0}
    [s] = w.drain_slices()
    assert (s.device, s.role, s.name) == (0, "shift", f"{label(before)}->{label(after)}")
    assert s.args == {"bytes": done.nbytes, "version": 1} and s.end >= s.start


@pytest.mark.parametrize("before", [None, Role.ROLLOUT, Role.JUDGE, Role.TRAIN], ids=label)
def test_generation_works_after_a_shift_to_rollout(store, before):
    w = make_worker(store)
    if before is not None:
        w.shift(before, 0)
    w.shift(Role.ROLLOUT, 1)
    w.generate(Generate(0, gen_requests(3), version=1))
    results = drain(w)
    assert [r.uid for r in results] == [0, 1, 2]
    for r in results:
        assert r.version == 1 and r.output_ids and len(r.logprobs) == len(r.output_ids)
        assert r.prompt_ids == w.ctx.tokenizer.encode(f"{r.uid}+{r.uid}=")
        assert r.finish_reason in ("stop", "length") and r.text == w.ctx.tokenizer.decode(r.output_ids)
    assert not w.has_work
    work = [s for s in w.drain_slices() if s.role == "rollout"]  # each slice says what it did, for profiles
    assert sum(s.args["tokens"] for s in work) == sum(len(r.output_ids) for r in results)
    assert work[0].args["running"] == 3 and work[0].args["prefill_tokens"] == sum(len(r.prompt_ids) for r in results)


@pytest.mark.parametrize("before", [None, Role.ROLLOUT, Role.JUDGE, Role.TRAIN], ids=label)
def test_judging_works_after_a_shift_to_judge(store, before):
    w = make_worker(store)
    if before is not None:
        w.shift(before, 0)
    w.shift(Role.JUDGE, 0)
    w.judge(Judge(0, judge_requests(3)))
    results = drain(w)
    assert [r.uid for r in results] == [0, 1, 2]
    for r in results:
        assert 0 < r.tokens <= GREEDY.max_new_tokens and (not r.truncated or r.tokens == GREEDY.max_new_tokens)
    assert not w.has_work


# -- releasing and refreshing -------------------------------------------------------


def test_shift_rollout_to_train_releases_engine_and_kv_cache(store):
    w = make_worker(store)
    w.shift(Role.ROLLOUT, 0)
    w.generate(Generate(0, gen_requests(2), version=0))
    drain(w)
    old_ctx, engine, cache = weakref.ref(w.ctx), weakref.ref(w.ctx.engine), weakref.ref(w.ctx.engine.cache)
    w.shift(Role.TRAIN, 0)
    gc.collect()
    assert isinstance(w.ctx, TrainContext) and w.ctx is not old_ctx()
    assert old_ctx() is None and engine() is None and cache() is None


def test_leaving_a_generation_role_frees_its_memory_at_once(store):
    """Weights and KV cache go when the shift returns, not at the next garbage collection: another role, or
    another device actor on the same GPU, can take the memory right away. Only a storage-less skeleton stays."""
    w = make_worker(store)
    w.shift(Role.ROLLOUT, 0)
    cache = weakref.ref(w.ctx.engine.cache.k)
    weight = weakref.ref(w.ctx.model.model.layers[0].mlp.up_proj.weight)
    gc.disable()
    try:
        w.shift(Role.JUDGE, 0)
        assert cache() is None and weight() is None
    finally:
        gc.enable()
    skeleton = w.kept[POLICY]
    assert {p.device.type for p in skeleton.model.parameters()} == {"meta"}


@pytest.mark.parametrize("via", [Role.JUDGE, Role.TRAIN], ids=label)
def test_returning_to_a_generation_role_reloads_into_its_skeleton(store, via):
    w = make_worker(store)
    w.shift(Role.ROLLOUT, 0)
    model, tokenizer = w.ctx.model, w.ctx.tokenizer
    w.shift(via, 0)
    w.shift(Role.ROLLOUT, 1)  # back, at another version
    assert w.ctx.model is model and w.ctx.tokenizer is tokenizer and POLICY not in w.kept
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again
    assert_holds(model, store, POLICY, 1)
    w.generate(Generate(0, gen_requests(4), version=1))
    fresh = make_worker(store, device=1)
    fresh.shift(Role.ROLLOUT, 1)
    fresh.generate(Generate(1, gen_requests(4), version=1))
    assert [r.output_ids for r in drain(w)] == [r.output_ids for r in drain(fresh)]


def test_rollout_runs_in_its_own_dtype(store):
    w = Worker(0, store, replace(SPEC, rollout_dtype="bfloat16"), TrainSpec(planned(), 1.0), origin=time.time())
    w.shift(Role.ROLLOUT, 0)
    assert {p.dtype for p in w.ctx.model.parameters()} == {torch.bfloat16}
    assert w.ctx.engine.cache.k.dtype == torch.bfloat16
    w.generate(Generate(0, gen_requests(2), version=0))
    assert all(r.output_ids for r in drain(w))
    w.shift(Role.JUDGE, 0)
    assert {p.dtype for p in w.ctx.model.parameters()} == {torch.float32}  # the judge keeps judge.dtype
    w.shift(Role.TRAIN, 0)
    assert {p.dtype for p in w.ctx.trainer.model.parameters()} == {torch.float32}  # the trainer keeps policy.dtype


@pytest.mark.parametrize("role", [Role.ROLLOUT, Role.JUDGE], ids=label)
def test_a_kv_budget_below_one_sequence_names_its_key(store, role):
    spec = replace(SPEC, kv_cache_bytes=1000)
    w = Worker(0, store, spec, TrainSpec(planned(), 1.0), origin=time.time())
    with pytest.raises(KVBudgetError, match=r"rollout\.kv_cache_gb=1e-06 gives a KV budget"):
        w.shift(role, 0)


def test_a_kv_budget_limits_the_slots_of_every_generation_engine(store):
    per_seq = bytes_per_token(tiny_model().config, torch.float32) * SPEC.judge_max_len
    w = Worker(0, store, replace(SPEC, kv_cache_bytes=3 * per_seq), TrainSpec(planned(), 1.0), time.time())
    w.shift(Role.JUDGE, 0)
    assert w.ctx.engine.max_batch == 3 and w.ctx.engine.cache.nbytes <= 3 * per_seq
    w.judge(Judge(0, judge_requests(5)))  # more requests than slots: they wait their turn
    assert len(drain(w)) == 5
    w.shift(Role.ROLLOUT, 0)
    assert w.ctx.engine.max_batch == min(SPEC.max_batch, 3 * SPEC.judge_max_len // SPEC.max_len)


def test_shifts_on_a_cpu_never_touch_cuda(store, monkeypatch):
    def no_cuda() -> None:
        raise AssertionError("CUDA called for a CPU device")

    monkeypatch.setattr(torch.cuda, "empty_cache", no_cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda)
    w = make_worker(store)
    for role in (Role.ROLLOUT, Role.JUDGE, Role.TRAIN, Role.ROLLOUT):
        w.shift(role, 0)


def test_rollout_to_rollout_refreshes_weights_in_place(store):
    w = make_worker(store)
    w.shift(Role.ROLLOUT, 0)
    ctx, engine = w.ctx, w.ctx.engine
    w.generate(Generate(0, gen_requests(4), version=0))
    before = [r.output_ids for r in drain(w)]

    w.shift(Role.ROLLOUT, 1)
    assert w.ctx is ctx and w.ctx.engine is engine and w.ctx.version == 1
    assert_holds(w.ctx.model, store, POLICY, 1)
    w.generate(Generate(0, gen_requests(4), version=1))
    after = [r.output_ids for r in drain(w)]

    fresh = make_worker(store, device=1)
    fresh.shift(Role.ROLLOUT, 1)
    fresh.generate(Generate(1, gen_requests(4), version=1))
    assert after == [r.output_ids for r in drain(fresh)]  # exactly what v1 loaded from scratch generates
    assert after != before


# -- refusals -------------------------------------------------------------------------


def test_generate_for_another_version_is_refused(store):
    w = make_worker(store)
    w.shift(Role.ROLLOUT, 0)
    with pytest.raises(WrongVersionError, match="holds policy v0, requests need v1"):
        w.generate(Generate(0, gen_requests(2), version=1))
    assert not w.has_work  # nothing was queued


def test_train_for_another_version_is_refused(store):
    w = make_worker(store)
    w.shift(Role.TRAIN, 0)
    shard = TrainShard(((1, 2),), ((3,),), ((-1.0,),), (1.0,))
    with pytest.raises(WrongVersionError, match="holds policy v0, update needs v1"):
        train(w, 0, 1, shard, 1)
    assert store.versions(POLICY) == [0, 1]  # nothing published


@pytest.mark.parametrize(
    ("before", "role"),
    [
        pytest.param(None, Role.ROLLOUT, id="none->rollout"),
        pytest.param(None, Role.TRAIN, id="none->train"),
        pytest.param(Role.ROLLOUT, Role.ROLLOUT, id="rollout->rollout"),
        pytest.param(Role.ROLLOUT, Role.TRAIN, id="rollout->train"),
        pytest.param(Role.JUDGE, Role.ROLLOUT, id="judge->rollout"),
    ],
)
def test_shift_to_a_version_absent_from_the_gps_names_it(store, before, role):
    w = make_worker(store)
    if before is not None:
        w.shift(before, 0)
    with pytest.raises(VersionError, match=r"no weights version 7 \(available: \[0, 1\]\)"):
        w.shift(role, 7)
    if before is role is Role.ROLLOUT:  # an in-place refresh fails before touching the weights
        assert w.ctx.version == 0
        assert_holds(w.ctx.model, store, POLICY, 0)
    done = w.shift(role, 1)  # a valid shift afterwards works
    assert done.role is role and w.ctx.version == 1


WRONG_ROLE = [
    pytest.param(before, kind, id=f"{label(before)}-gets-{kind}")
    for before, kinds in (
        (None, ("generate", "judge", "train")),
        (Role.ROLLOUT, ("judge", "train")),
        (Role.JUDGE, ("generate", "train")),
        (Role.TRAIN, ("generate", "judge")),
    )
    for kind in kinds
]


@pytest.mark.parametrize(("before", "kind"), WRONG_ROLE)
def test_requests_for_another_role_are_refused(store, before, kind):
    w = make_worker(store)
    if before is not None:
        w.shift(before, 0)
    with pytest.raises(RuntimeError, match="cannot serve|not in the train role") as info:
        if kind == "generate":
            w.generate(Generate(0, gen_requests(1), version=0))
        elif kind == "judge":
            w.judge(Judge(0, judge_requests(1)))
        else:
            train(w, 0, 0, TrainShard(((1,),), ((2,),), ((-1.0,),), (1.0,)), 1)
    assert not isinstance(info.value, WrongVersionError)
    assert not w.has_work


@pytest.mark.parametrize(
    ("holding", "to"),
    [
        pytest.param(Role.ROLLOUT, Role.TRAIN, id="rollout-busy->train"),
        pytest.param(Role.ROLLOUT, Role.ROLLOUT, id="rollout-busy->rollout"),
        pytest.param(Role.JUDGE, Role.ROLLOUT, id="judge-busy->rollout"),
        pytest.param(Role.JUDGE, Role.JUDGE, id="judge-busy->judge"),
    ],
)
def test_shift_with_sequences_in_flight_is_refused(store, holding, to):
    w = make_worker(store)
    w.shift(holding, 0)
    ctx = w.ctx
    if holding is Role.ROLLOUT:
        w.generate(Generate(0, gen_requests(2), version=0))
    else:
        w.judge(Judge(0, judge_requests(2)))
    with pytest.raises(RuntimeError, match="with sequences in flight"):
        w.shift(to, 1)
    assert w.ctx is ctx and w.role is holding and ctx.version == 0
    assert [r.uid for r in drain(w)] == [0, 1]  # the work goes on undisturbed


# -- the train role ---------------------------------------------------------------------


def rollout_shard(store: LocalStore) -> tuple[TrainShard, int]:
    """Four sampled responses of policy v0 as one shard (two groups of two), and their token count."""
    w = make_worker(store, device=9)
    w.shift(Role.ROLLOUT, 0)
    w.generate(Generate(9, gen_requests(4, SAMPLED), version=0))
    results = drain(w)
    shard = TrainShard(
        tuple(tuple(r.prompt_ids) for r in results),
        tuple(tuple(r.output_ids) for r in results),
        tuple(tuple(r.logprobs) for r in results),
        (1.0, -1.0, -1.0, 1.0),
    )
    return shard, sum(len(r.output_ids) for r in results)


def test_train_publishes_weights_and_optimizer_state_and_the_next_trainer_restores_them():
    store = LocalStore()
    publish_checkpoint(store, POLICY, 0, tiny_model(seed=0), char_tokenizer())
    shard, tokens = rollout_shard(store)

    w = make_worker(store)
    w.shift(Role.ROLLOUT, 0)
    done = w.shift(Role.TRAIN, 0)
    assert done.nbytes == store.fetch(POLICY, 0).nbytes  # no optimizer state before the first update
    w.drain_slices()

    trained = train(w, 0, 0, shard, tokens)

    assert isinstance(trained, Trained)
    assert (trained.devices, trained.version) == ((0,), 1) and trained.seconds > 0
    assert trained.stats["tokens"] == tokens and trained.stats["skipped"] == 0.0
    assert w.ctx.version == 1
    assert store.versions(POLICY, Kind.WEIGHTS) == [0, 1] and store.versions(POLICY, Kind.OPTIMIZER) == [1]
    assert_holds(w.ctx.trainer.model, store, POLICY, 1)
    old = store.fetch(POLICY, 0).tensors
    assert any(not torch.equal(t, old[k]) for k, t in store.fetch(POLICY, 1).tensors.items())  # the update moved
    assert set(adam_steps(w.ctx)) == {1.0}
    backward, step = w.drain_slices()
    assert (backward.role, backward.name) == ("train", f"accumulate {len(shard.response_ids)}")
    assert backward.args["samples"] == len(shard.response_ids) and backward.args["tokens"] > 0
    assert (step.role, step.name) == ("train", "step v0->v1")

    w2 = make_worker(store, device=1)
    done = w2.shift(Role.TRAIN, 1)
    assert done.nbytes == store.fetch(POLICY, 1).nbytes + store.fetch(POLICY, 1, Kind.OPTIMIZER).nbytes
    assert adam_steps(w2.ctx) and set(adam_steps(w2.ctx)) == {1.0}  # AdamW state restored, not fresh
    opt1, opt2 = w.ctx.trainer.replica.trainer.optimizer, w2.ctx.trainer.replica.trainer.optimizer
    p1, p2 = dict(w.ctx.trainer.model.named_parameters()), dict(w2.ctx.trainer.model.named_parameters())
    for name, p in p2.items():
        assert torch.equal(opt2.state[p]["exp_avg"], opt1.state[p1[name]]["exp_avg"]), name

    trained = train(w2, 1, 1, shard, tokens)

    assert trained.version == 2 and set(adam_steps(w2.ctx)) == {2.0}
    assert store.versions(POLICY, Kind.WEIGHTS) == [1, 2]  # retention: at most two weight versions
    assert store.versions(POLICY, Kind.OPTIMIZER) == [2]


def test_a_trainer_that_missed_an_update_must_shift_to_the_new_version_first():
    store = LocalStore()
    publish_checkpoint(store, POLICY, 0, tiny_model(seed=0), char_tokenizer())
    shard, tokens = rollout_shard(store)
    a, b = make_worker(store, 0), make_worker(store, 1)
    a.shift(Role.TRAIN, 0)
    b.shift(Role.TRAIN, 0)
    train(a, 0, 0, shard, tokens)
    with pytest.raises(WrongVersionError):
        train(b, 1, 1, shard, tokens)
    b.shift(Role.TRAIN, 1)
    assert train(b, 1, 1, shard, tokens).version == 2


def job_plan(*overrides: str, kind: str = "cpu") -> Plan:
    """The plan a job of ``overrides`` resolves to on devices of ``kind`` whose memory is not known."""
    return resolve(load_config(None, list(overrides)), Hardware(kind))  # type: ignore[arg-type]


def test_the_driver_configures_the_trainer_before_the_run_and_not_after(store):
    """configure gives a device the train config the job made concrete (here ZeRO-1 for auto): the next
    train context is built with it; once one is built, configuring is refused."""
    w = make_worker(store)
    w.configure(job_plan("train.backend=zero"))
    w.shift(Role.TRAIN, 1)
    assert w.ctx.trainer.traits.kind is TrainerKind.ZERO and w.ctx.trainer.shard is not None
    with pytest.raises(RuntimeError, match="configure it before the run"):
        w.configure(job_plan())


def test_the_plan_gives_a_device_its_models_dtypes_and_backends(store):
    """The dtypes, backends and migration audit a device's contexts take are the plan's (``Plan.serving``): the
    judge is served in the plan's dtype, whatever the spec the device started with held."""
    w = Worker(0, store, replace(SPEC, judge_dtype=""), TrainSpec(planned(), 1.0), origin=time.time())
    plan = job_plan("judge.dtype=bfloat16", "rollout.audit_migrations=on")
    w.configure(plan)
    assert (w.spec.judge_dtype, w.spec.rollout_dtype, w.spec.audit_migrations) == ("bfloat16", "float32", True)
    assert (w.spec.rollout_backend, w.spec.judge_backend) == ("native", "native")  # (auto on a CPU)
    w.shift(Role.JUDGE, 0)
    assert {p.dtype for p in w.ctx.model.parameters()} == {torch.bfloat16}


def test_a_retired_train_group_hands_its_memory_back(store, monkeypatch):
    """Leaving a train group for the next one frees what the old one held on the device (on a GPU: the
    collector for FSDP2's cycles, then the allocator's cache), before the next group's trainer is built."""
    import pivotrl.runtime.worker as worker_module

    freed: list[str] = []
    monkeypatch.setattr(worker_module, "release_device_memory", freed.append)
    w = make_worker(store)
    w.shift(Role.TRAIN, 1)
    w.retire_group()
    assert freed == ["cpu"]


def test_a_member_failing_out_of_its_optimizer_step_leaves_the_group(store, monkeypatch):
    """A member whose collective fails (a member of its group was lost) leaves the process group at once: the
    others waiting for it in the same collective then fail too, instead of waiting until the driver kills them."""
    w = make_worker(store)

    class Group:
        left = False
        after: BaseException | None = None

        def leave(self) -> None:
            self.left = True

        def leave_after(self, error: BaseException) -> None:  # (the error's frames let go of first)
            self.after = error
            self.leave()

    group = w.group = Group()
    w.group_devices = (0, 1, 2)

    def lost_peer(*args: object) -> None:
        raise RuntimeError("[gloo] Connection closed by peer")

    monkeypatch.setattr(w, "_train_ctx", lambda version: None)
    monkeypatch.setattr(w, "_step", lost_peer)
    with pytest.raises(RuntimeError, match="closed by peer"):
        w.step(Step((0, 1, 2), 0, 10), 0, None)
    assert group.left and "closed by peer" in str(group.after) and w.group is None and w.group_devices == ()
    assert w.progress() == -1  # (no longer in a step)
