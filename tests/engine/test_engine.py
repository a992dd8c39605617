"""Continuous-batching engine: batch invariance, abort/resume, log-probs, slot reuse, stopping, validation."""

import copy
import random

import pytest
import torch

from pivotrl.engine import Engine, SamplingParams, SeqState
from pivotrl.engine.kv_budget import KEY, KVBudget, KVBudgetError, bytes_per_token
from pivotrl.model import Decoder
from tests.conftest import tiny_config

VOCAB = 24
STOP = 2
MAX_NEW = 24
MAX_LEN = 64
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=(STOP,))


@pytest.fixture(scope="module")
def model() -> Decoder:
    torch.manual_seed(0)
    model = Decoder(tiny_config("LlamaForCausalLM", VOCAB)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
        model.lm_head.weight[STOP] *= 1.6  # about half the sequences stop before max_new_tokens
    return model


def requests(n: int = 40, first_uid: int = 0, seed: int = 2, params: SamplingParams = PARAMS) -> list[SeqState]:
    rng = random.Random(seed)
    return [
        SeqState(
            uid=first_uid + i,
            prompt_ids=[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))],
            seed=rng.randrange(2**40),
            params=params,
        )
        for i in range(n)
    ]


def others() -> list[SeqState]:
    """Unrelated requests with other sampling parameters, to mix into a batch."""
    variants = [
        SamplingParams(max_new_tokens=10, temperature=0.0),
        SamplingParams(max_new_tokens=30, temperature=0.7, top_k=4),
        SamplingParams(max_new_tokens=17, temperature=1.5, top_p=0.8, stop_token_ids=(5, 6)),
    ]
    return [s for i, p in enumerate(variants) for s in requests(8, first_uid=1000 + 100 * i, seed=10 + i, params=p)]


def drain(*engines: Engine) -> None:
    while any(e.has_work for e in engines):
        for e in engines:
            e.step()


def by_uid(states: list[SeqState]) -> dict[int, SeqState]:
    return {s.uid: s for s in states}


def assert_same(got: dict[int, SeqState], want: dict[int, SeqState]) -> None:
    """Same tokens and finish reasons; log-probs equal up to float32 reduction order (batch shapes differ)."""
    for uid, w in want.items():
        g = got[uid]
        assert g.done, uid
        assert g.output_ids == w.output_ids, uid
        assert g.finish_reason == w.finish_reason, uid
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=1e-5), uid


@pytest.fixture(scope="module")
def reference(model) -> dict[int, SeqState]:
    """The 40 requests, run uninterrupted in one wide batch."""
    return by_uid(Engine(model, max_batch=64, max_len=MAX_LEN).generate(requests()))


def test_reference_is_varied(reference):
    """Guards the other tests: lengths and finish reasons vary, so batches change shape as sequences end."""
    reasons = [s.finish_reason for s in reference.values()]
    assert 10 <= reasons.count("stop") <= 30
    assert len({len(s.output_ids) for s in reference.values()}) >= 10
    assert len({tuple(s.output_ids) for s in reference.values()}) == 40


# -- batch invariance ------------------------------------------------------------------------------------


def shuffled(states: list[SeqState]) -> list[SeqState]:
    states = list(states)
    random.Random(3).shuffle(states)
    return states


@pytest.mark.parametrize(
    "max_batch, max_prefill_tokens, mixed",
    [
        pytest.param(7, 8192, False, id="batch-7"),
        pytest.param(1, 8192, False, id="batch-1"),
        pytest.param(5, 16, False, id="prefill-budget"),
        pytest.param(64, 8192, True, id="mixed-shuffled-64"),
        pytest.param(6, 8192, True, id="mixed-shuffled-6"),
    ],
)
def test_tokens_independent_of_batch_composition(model, reference, max_batch, max_prefill_tokens, mixed):
    states = requests()
    if mixed:
        states = shuffled(states + others())
    engine = Engine(model, max_batch=max_batch, max_len=MAX_LEN, max_prefill_tokens=max_prefill_tokens)
    got = by_uid(engine.generate(states))
    assert_same(got, reference)


def test_generate_returns_input_order(model):
    states = shuffled(requests(6))
    out = Engine(model, max_batch=2, max_len=MAX_LEN).generate(states)
    assert [s.uid for s in out] == [s.uid for s in states]
    assert all(a is b for a, b in zip(out, states, strict=True))


# -- abort / resume --------------------------------------------------------------------------------------


def test_abort_running_and_resume_elsewhere(model, reference):
    a = Engine(model, max_batch=16, max_len=MAX_LEN)
    states = requests()
    for s in states:
        a.add(s)
    for _ in range(8):
        a.step()
    victims = list(a.running)[::2]
    assert len(victims) >= 4
    assert any(0 < len(a.running[u].output_ids) < MAX_NEW for u in victims)
    moved = [a.abort(u) for u in victims]
    assert [s.uid for s in moved] == victims
    assert not set(victims) & (set(a.running) | set(a.slot_of) | {s.uid for s in a.waiting})
    assert a.stats.aborted == len(victims)
    assert all(not s.done for s in moved)

    b = Engine(model, max_batch=3, max_len=MAX_LEN)
    for s in moved:
        b.add(s)
    drain(a, b)
    assert_same(by_uid(states), reference)
    assert sorted(a.free_slots) == list(range(16)) and sorted(b.free_slots) == list(range(3))


def test_abort_waiting_sequence(model, reference):
    a = Engine(model, max_batch=2, max_len=MAX_LEN)
    states = requests()
    for s in states:
        a.add(s)
    a.step()  # admits two
    waiting_uid = a.waiting[3].uid
    moved = a.abort(waiting_uid)
    assert moved.uid == waiting_uid and moved.output_ids == [] and moved.logprobs == []
    assert waiting_uid not in {s.uid for s in a.waiting}
    assert len(a.running) == 2 and len(a.free_slots) == 0  # no slot touched
    b = Engine(model, max_batch=4, max_len=MAX_LEN)
    b.add(moved)
    drain(a, b)
    assert_same(by_uid(states), reference)


def test_abort_twice(model, reference):
    long_uids = [u for u, s in reference.items() if s.finish_reason == "length"]
    a = Engine(model, max_batch=8, max_len=MAX_LEN)
    states = requests()
    for s in states:
        a.add(s)
    for _ in range(5):
        a.step()
    uid = next(u for u in long_uids if u in a.running)
    first = a.abort(uid)
    n_first = len(first.output_ids)
    assert n_first > 0

    b = Engine(model, max_batch=2, max_len=MAX_LEN)
    b.add(first)
    for _ in range(4):
        b.step()
    second = b.abort(uid)
    assert second is first and len(second.output_ids) > n_first and not second.done
    assert not b.has_work

    c = Engine(model, max_batch=1, max_len=MAX_LEN)
    c.add(second)
    drain(a, c)
    assert_same(by_uid(states), reference)


def test_abort_all_and_resume(model, reference):
    a = Engine(model, max_batch=6, max_len=MAX_LEN)
    states = requests()
    for s in states:
        a.add(s)
    for _ in range(10):
        a.step()
    moved = a.abort_all()
    assert not a.has_work and sorted(a.free_slots) == list(range(6))
    assert {s.uid for s in moved} == {s.uid for s in states if not s.done}
    Engine(model, max_batch=64, max_len=MAX_LEN).generate(moved)
    assert_same(by_uid(states), reference)


def test_abort_unknown_or_finished(model):
    e = Engine(model, max_batch=4, max_len=MAX_LEN)
    with pytest.raises(KeyError, match="12345"):
        e.abort(12345)
    (s,) = e.generate(requests(1))
    with pytest.raises(KeyError):
        e.abort(s.uid)
    with pytest.raises(ValueError, match="already finished"):
        e.add(s)


def test_duplicate_uid_rejected(model):
    engine = Engine(model, max_batch=4, max_len=MAX_LEN)
    first, second = requests(2)
    second.uid = first.uid
    engine.add(first)
    with pytest.raises(ValueError, match=str(first.uid)):
        engine.add(second)


# -- log-probs -------------------------------------------------------------------------------------------


@torch.no_grad()
def assert_logprobs_match_forward(model: Decoder, states: list[SeqState], atol: float = 1e-4) -> None:
    for s in states:
        temperature = s.params.temperature if s.params.temperature > 0 else 1.0
        ids = torch.tensor(s.prompt_ids + s.output_ids)
        logits = model(ids[None, :-1])[0, len(s.prompt_ids) - 1 :]
        want = torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(s.output_ids)[:, None])
        assert len(s.logprobs) == len(s.output_ids)
        assert torch.allclose(torch.tensor(s.logprobs), want.squeeze(-1), atol=atol, rtol=0), s.uid


def test_logprobs_equal_full_forward(model, reference):
    assert_logprobs_match_forward(model, list(reference.values()))


def test_logprobs_equal_full_forward_other_params(model):
    states = Engine(model, max_batch=5, max_len=MAX_LEN).generate(others())
    assert_logprobs_match_forward(model, states)


# -- continuous batching ---------------------------------------------------------------------------------


def test_continuous_batching_reuses_slots(model):
    engine = Engine(model, max_batch=4, max_len=MAX_LEN)
    states = requests(10, seed=5)
    for s in states:
        engine.add(s)
    finished: list[SeqState] = []
    refill_checked = 0
    while engine.has_work:
        waiting_before = len(engine.waiting)
        prefill_before = engine.stats.prefill_tokens
        done = engine.step()
        finished += done
        assert len(engine.running) <= 4
        assert len(engine.running) + len(engine.free_slots) == 4
        used = set(engine.slot_of.values())
        assert len(used) == len(engine.running) and not used & set(engine.free_slots)
        assert set(engine.slot_of) == set(engine.running) == set(engine.cached)
        for s in engine.running.values():  # the cache holds all but the newest token
            assert engine.cached[s.uid] == len(s.prompt_ids) + len(s.output_ids) - 1
        if done and engine.waiting and waiting_before:
            # freed slots are taken on the very next step, not when the batch drains
            engine.step()
            refill_checked += 1
            assert engine.stats.prefill_tokens > prefill_before
    assert refill_checked > 0
    assert sorted(s.uid for s in finished) == list(range(10))
    assert all(s.done for s in states)
    assert sorted(engine.free_slots) == [0, 1, 2, 3]
    assert engine.stats.finished == 10
    assert engine.stats.decode_tokens + len(states) == sum(len(s.output_ids) for s in states)
    # each decode step of a sequence attends to its prompt and every token it has made so far
    want = sum(len(s.prompt_ids) + j for s in states for j in range(1, len(s.output_ids)))
    assert engine.stats.kv_read_tokens == want


def test_prefill_budget_limits_admission(model):
    engine = Engine(model, max_batch=8, max_len=MAX_LEN, max_prefill_tokens=20)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    for uid in range(4):
        engine.add(SeqState(uid=uid, prompt_ids=[3 + uid] * 9, seed=uid, params=params))
    engine.add(SeqState(uid=9, prompt_ids=[5] * 30, seed=9, params=params))
    engine.step()
    assert len(engine.running) == 2  # 9 + 9 <= 20 < 27
    engine.step()
    assert len(engine.running) == 4
    engine.step()
    assert len(engine.running) == 5  # over the budget alone: still admitted, never starved
    drain(engine)
    assert engine.stats.finished == 5


# -- stopping --------------------------------------------------------------------------------------------


def test_stop_and_length_in_reference(reference):
    for s in reference.values():
        assert STOP not in s.output_ids[:-1]
        if s.finish_reason == "stop":
            assert s.output_ids[-1] == STOP
            assert len(s.output_ids) <= MAX_NEW
        else:
            assert s.finish_reason == "length"
            assert len(s.output_ids) == MAX_NEW and STOP not in s.output_ids


def test_stop_token_cuts_greedy_sequence(model):
    prompt = [4, 9, 13]
    free = SamplingParams(max_new_tokens=20, temperature=0.0)
    (run,) = Engine(model, max_batch=2, max_len=MAX_LEN).generate([SeqState(0, prompt, 0, free)])
    assert run.finish_reason == "length" and len(run.output_ids) == 20
    stop = run.output_ids[5]
    cut = run.output_ids.index(stop)
    assert cut > 0
    for params in [
        SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(stop,)),
        SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(VOCAB + 5, stop)),
        SamplingParams(max_new_tokens=cut + 1, temperature=0.0, stop_token_ids=(stop,)),  # stop wins over length
    ]:
        (s,) = Engine(model, max_batch=2, max_len=MAX_LEN).generate([SeqState(1, prompt, 0, params)])
        assert s.output_ids == run.output_ids[: cut + 1]
        assert s.finish_reason == "stop"
        assert s.logprobs == pytest.approx(run.logprobs[: cut + 1], abs=1e-5)
    (s,) = Engine(model, max_batch=2, max_len=MAX_LEN).generate(
        [SeqState(2, prompt, 0, SamplingParams(max_new_tokens=7, temperature=0.0))]
    )
    assert s.output_ids == run.output_ids[:7] and s.finish_reason == "length"


def test_single_token(model):
    (s,) = Engine(model, max_batch=1, max_len=8).generate([SeqState(0, [5, 6], 3, SamplingParams(max_new_tokens=1))])
    assert len(s.output_ids) == 1 and s.finish_reason in ("stop", "length")


# -- validation ------------------------------------------------------------------------------------------


def test_request_too_long(model):
    engine = Engine(model, max_batch=2, max_len=32)
    with pytest.raises(ValueError, match=r"\(10\).*\(30\).*40.*32"):
        engine.add(SeqState(0, [3] * 10, 0, SamplingParams(max_new_tokens=30)))
    assert not engine.has_work


def test_request_exactly_max_len(model):
    engine = Engine(model, max_batch=2, max_len=32)
    (s,) = engine.generate([SeqState(0, [3] * 8, 0, SamplingParams(max_new_tokens=24, temperature=0.0))])
    assert len(s.output_ids) == 24


def test_empty_prompt(model):
    engine = Engine(model, max_batch=2, max_len=32)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add(SeqState(0, [], 0, SamplingParams(max_new_tokens=4)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"max_new_tokens": 0}, "max_new_tokens", id="max-new-zero"),
        pytest.param({"top_p": 0.0}, "top_p", id="top-p-zero"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-above-one"),
        pytest.param({"top_k": -1}, "top_k", id="top-k-negative"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_ensure_capacity(model):
    engine = Engine(model, max_batch=2, max_len=16)
    cache = engine.cache
    engine.ensure_capacity(8)  # smaller: nothing changes
    assert engine.cache is cache and engine.max_len == 16
    engine.ensure_capacity(48)
    assert engine.max_len == 48 and engine.cache.max_len == 48 and engine.cache.slots == 2
    engine.add(SeqState(0, [3] * 20, 0, SamplingParams(max_new_tokens=28, temperature=0.0)))
    engine.step()
    engine.ensure_capacity(40)  # already large enough: allowed while busy
    with pytest.raises(RuntimeError, match="in flight"):
        engine.ensure_capacity(64)
    assert engine.max_len == 48
    drain(engine)
    engine.ensure_capacity(64)
    assert engine.cache.max_len == 64


def test_state_survives_copy(model, reference):
    """SeqState is plain data: a deep copy taken at abort resumes as well as the original."""
    a = Engine(model, max_batch=8, max_len=MAX_LEN)
    states = requests()
    for s in states:
        a.add(s)
    for _ in range(6):
        a.step()
    uid = next(iter(a.running))
    copied = copy.deepcopy(a.abort(uid))
    b = Engine(model, max_batch=8, max_len=MAX_LEN)
    b.add(copied)
    drain(a, b)
    assert_same({uid: copied}, {uid: reference[uid]})


# -- a KV-cache budget ---------------------------------------------------------------


def test_engine_under_a_budget_runs_fewer_sequences_at_once_with_the_same_tokens(model, reference) -> None:
    budget = KVBudget(3 * MAX_LEN * bytes_per_token(model.config, torch.float32) + 5)
    engine = Engine(model, max_batch=64, max_len=MAX_LEN, kv_budget=budget)
    assert engine.max_batch == 3 and engine.cache.k.shape[1] == 3 and engine.cache.nbytes == engine.plan.nbytes
    assert_same(by_uid(engine.generate(requests())), reference)


def test_growing_the_cache_under_a_budget_trades_slots_for_length(model) -> None:
    per_token = bytes_per_token(model.config, torch.float32)
    engine = Engine(model, max_batch=8, max_len=32, kv_budget=KVBudget(4 * 32 * per_token))
    assert (engine.max_batch, engine.max_len) == (4, 32)
    engine.ensure_capacity(64)
    assert (engine.max_batch, engine.max_len) == (2, 64) and engine.cache.k.shape[1] == 2
    assert sorted(engine.free_slots) == [0, 1]
    with pytest.raises(KVBudgetError, match=KEY):
        engine.ensure_capacity(4 * 32 + 1)
    assert (engine.max_batch, engine.max_len) == (2, 64)  # a refused resize leaves the cache as it was
