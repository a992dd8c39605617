import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from pivotrl import checkpoint as ckpt
from pivotrl.config import load_config
from pivotrl.control.controller import sequence_seed
from pivotrl.errors import UserError
from pivotrl.gps import LocalStore
from pivotrl.model import CheckpointError, Tokenizer
from pivotrl.model.chat import load_chat_template
from pivotrl.resolve import Hardware, resolve
from pivotrl.reward.genrm import judge_prompt
from pivotrl.runtime import job
from pivotrl.runtime.contexts import JUDGE, ContextSpec
from pivotrl.runtime.job import chat_templates, context_spec, run_job
from pivotrl.task import checkers
from pivotrl.task.data import read_jsonl, read_problems, write_parquet
from tests.model.test_chat import CHATML, LLAMA3

ROOT = Path(__file__).resolve().parents[2]


def small_job(ckpt: dict[str, Path], *extra: str):
    return load_config(
        ROOT / "examples/default.yaml",
        [
            f"policy.path={ckpt['policy']}",
            f"judge.path={ckpt['judge']}",
            f"task.train_file={ROOT / 'data/arithmetic/train.jsonl'}",
            f"task.heldout_file={ROOT / 'data/arithmetic/heldout.jsonl'}",
            "mode=colocated",
            "devices=1",
            "steps=3",
            "rollout.max_new_tokens=8",
            "eval.max_new_tokens=8",
            "rollout.prompts_per_step=4",
            "rollout.group_size=3",
            "judge.max_new_tokens=12",
            "eval.size=16",
            "eval.every=2",
            "device_timeout=120",  # a stalled call in a test is lost after 2 minutes, not 10
            "threads_per_device=1",  # every device alike, in process or in an actor: same samples, no thread barriers
            *extra,
        ],
    )


def test_job_runs_end_to_end_and_writes_its_outputs(tiny_checkpoints, tmp_path):
    cfg = small_job(tiny_checkpoints)
    summary = run_job(cfg, tmp_path, progress=False)
    for key in ("mode", "steps", "samples_per_s", "accuracy_start", "accuracy_end", "judge_agreement"):
        assert key in summary
    assert summary["samples"] == 3 * 4 * 3 and summary["samples_per_s"] > 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert "heldout_accuracy" in lines[1] and "heldout_accuracy" not in lines[0]
    for m in lines:
        assert {"reward_mean", "judge_agreement", "parse_failures", "response_length", "tokens_per_s"} <= m.keys()
        assert set(m["time_s"]) >= {"rollout", "judge", "train"}
    # a random judge writes garbage: every failure is counted, none is fatal, each got the fallback reward
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["judge_parse_failures"] == sum(m["parse_failures"] for m in lines) > 0
    assert (tmp_path / "policy" / "model.safetensors").is_file()
    for name in ("events.jsonl", "trace.json", "timeline.png", "config.json"):
        assert (tmp_path / name).is_file(), name
    roles = {json.loads(x)["role"] for x in (tmp_path / "events.jsonl").read_text().splitlines()}
    assert roles == {"rollout", "judge", "train", "shift"}  # evaluation is greedy generation in the rollout role
    # colocated on one device: rollout -> judge -> train -> rollout ..., every shift loads from the GPS
    assert on_disk["shifts"] >= 3 * 3 and on_disk["shift_seconds"]["max"] > 0
    assert 0 < sum(on_disk["role_busy_fraction"].values()) <= 1.0


def test_a_job_on_parquet_and_save_to_disk_data_with_mapped_fields_measures_with_its_checker(
    tiny_checkpoints, tmp_path, monkeypatch
):
    """task.checker=math reaches the controller as a plain function: every sample's ``correct`` and every
    held-out answer is math-verify's verdict on the response and the reference read through the mapped fields."""
    import datasets

    train = read_jsonl(ROOT / "data/arithmetic/train.jsonl")[:64]
    write_parquet(train, tmp_path / "train.parquet", "problem", "answer")
    heldout = read_jsonl(ROOT / "data/arithmetic/heldout.jsonl")[:16]
    columns = {"problem": [p.question for p in heldout], "answer": [p.reference for p in heldout]}
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "heldout"))
    calls: list[tuple[str, str, bool]] = []

    def spy(response: str, reference: str) -> bool:
        calls.append((response, reference, checkers.math_match(response, reference)))
        return calls[-1][2]

    monkeypatch.setitem(checkers.CHECKERS, "math", spy)
    cfg = small_job(
        tiny_checkpoints,
        "steps=2",
        f"task.train_file={tmp_path / 'train.parquet'}",
        f"task.heldout_file={tmp_path / 'heldout'}",
        "task.question_field=problem",
        "task.reference_field=answer",
        "task.checker=math",
    )
    summary = run_job(cfg, tmp_path / "run", progress=False)

    references = {p.question: p.reference for p in read_problems(tmp_path / "train.parquet", "problem", "answer")}
    rows = [json.loads(x) for x in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 * 3 and {r["question"] for r in rows} <= references.keys()
    verdicts = {(response, reference): ok for response, reference, ok in calls}
    for r in rows:
        assert r["correct"] == verdicts[(r["response"], references[r["question"]])]
    evaluations = 2  # before the first step and after the last
    assert len(calls) == len(rows) + evaluations * len(heldout)
    assert {reference for _, reference, _ in calls[-len(heldout) :]} <= {p.reference for p in heldout}
    assert 0 <= summary["accuracy_end"] <= 1


def test_same_seed_same_samples(tiny_checkpoints, tmp_path):
    a = run_job(small_job(tiny_checkpoints, "steps=1"), tmp_path / "a", progress=False)
    b = run_job(small_job(tiny_checkpoints, "steps=1"), tmp_path / "b", progress=False)
    ma = json.loads((tmp_path / "a/metrics.jsonl").read_text())
    mb = json.loads((tmp_path / "b/metrics.jsonl").read_text())
    assert ma["reward_mean"] == mb["reward_mean"] and ma["response_length"] == mb["response_length"]
    assert a["accuracy_end"] == b["accuracy_end"]


def test_sequence_seeds_are_distinct_per_step_and_sample():
    seeds = {sequence_seed(0, step, uid) for step in range(20) for uid in range(256)}
    assert len(seeds) == 20 * 256


def test_shiftable_mode_runs_and_keeps_the_samples_of_colocated(tiny_checkpoints, tmp_path):
    """The planner decides where work runs, never what is sampled."""
    plain = run_job(small_job(tiny_checkpoints, "steps=2"), tmp_path / "colocated", progress=False)
    planned = run_job(small_job(tiny_checkpoints, "steps=2", "mode=shiftable"), tmp_path / "shiftable", progress=False)
    assert planned["mode"] == "shiftable" and planned["shifts"] > 0
    a = [json.loads(x) for x in (tmp_path / "colocated/metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "shiftable/metrics.jsonl").read_text().splitlines()]
    for x, y in zip(a, b, strict=True):
        assert (x["reward_mean"], x["response_tokens"]) == (y["reward_mean"], y["response_tokens"])
    assert planned["accuracy_end"] == plain["accuracy_end"]


def test_shiftable_run_writes_its_decision_log(tiny_checkpoints, tmp_path):
    run_job(small_job(tiny_checkpoints, "steps=1", "mode=shiftable"), tmp_path, progress=False)
    decisions = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert decisions and all(d["moves"] and d["reason"] for d in decisions)
    assert {m[2] for d in decisions for m in d["moves"]} == {"rollout", "judge", "train"}


def test_kl_to_the_initial_policy_is_trained_and_reported(tiny_checkpoints, tmp_path):
    """train.kl_coef > 0: the reference (the initial policy) is published to the GPS beside it, and every
    shift into the train role builds the frozen reference from there."""
    summary = run_job(small_job(tiny_checkpoints, "steps=2", "train.kl_coef=0.05"), tmp_path, progress=False)
    assert (summary["train_backend"], summary["train_min_devices"]) == ("replicated", 1)  # (auto on a CPU)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("train_kl" in m and m["train_kl"] >= 0 for m in lines)


def test_context_spec_carries_the_kv_budget_and_the_plan_its_dtypes():
    """The spec a device starts with holds what the job says; the dtypes, backends and audit are the plan's, made
    once the devices are up and given to each with it (``Worker.configure``), empty until then."""
    cfg = load_config(None, ["policy.dtype=float32", "rollout.kv_cache_gb=2.5"])
    on_gpu, on_cpu = context_spec(cfg, device="cuda"), context_spec(cfg)
    assert (on_gpu.rollout_dtype, on_gpu.judge_dtype, on_gpu.rollout_backend, on_gpu.judge_backend) == ("",) * 4
    on_gpu = replace(on_gpu, **resolve(cfg, Hardware("cuda")).serving())
    on_cpu = replace(on_cpu, **resolve(cfg, Hardware("cpu")).serving())
    assert (on_gpu.device, on_gpu.rollout_dtype, on_gpu.policy_dtype) == ("cuda", "bfloat16", "float32")
    assert (on_cpu.device, on_cpu.rollout_dtype) == ("cpu", "float32")
    assert on_gpu.kv_cache_bytes == on_cpu.kv_cache_bytes == 2_500_000_000
    assert context_spec(load_config(None, [])).kv_cache_bytes == 0  # auto


def test_auto_min_train_devices_follow_the_policy_and_the_gpu_memory(tmp_path):
    """train.min_devices=auto: as many train devices as the trainer's state needs on GPUs of that memory (the
    arithmetic pivotrl plan prints), 1 where memory is unknown (CPUs), the key as given otherwise; none of the
    job's devices enough is one line naming what helps."""
    from tests.test_cli import write_qwen7b_config

    policy = write_qwen7b_config(tmp_path)
    paths = [f"policy.path={policy}", f"judge.path={policy}"]  # (the judge's architecture: for its limits)

    def min_train(cfg, kind: str, memory: float | None) -> int:
        return job.resolve_run(cfg, kind, memory, ContextSpec()).min_train_devices

    cfg = load_config(None, [*paths, "devices=8", "train.activation_checkpointing=true"])
    assert min_train(cfg, "cuda", 80e9) == 3  # FSDP2, bf16, 16k-token micro batches
    auto = load_config(None, [*paths, "devices=8"])  # (checkpointing auto: on, on 80 GB)
    assert min_train(auto, "cuda", 80e9) == 3
    assert min_train(cfg, "cpu", None) == 1
    assert min_train(replace(cfg, train=replace(cfg.train, min_devices=2)), "cuda", 80e9) == 2
    with pytest.raises(UserError, match=r"train.min_devices=auto: training 7.62B parameters with train.backend=fsdp "
                       r"needs \d+ GB a device even on all 8 devices, more than 90% of their 10 GB"):  # fmt: skip
        min_train(cfg, "cuda", 10e9)


def test_a_run_refuses_what_its_gpus_cannot_hold_in_one_line(tmp_path, caplog):
    """Resolved against the devices: a judge dtype their GPUs do not compute in, and a device share too small for
    its largest role and its processes' CUDA contexts (the arithmetic pivotrl plan prints), are one line naming the
    key; auto's native engine on CUDA, vLLM not installed, is said in the log with how to install it."""
    from tests.test_cli import write_qwen7b_config

    policy = write_qwen7b_config(tmp_path)
    paths = [f"policy.path={policy}", f"judge.path={policy}"]
    with pytest.raises(UserError, match=r"^judge.dtype=bfloat16: these GPUs do not compute in bfloat16"):
        job.resolve_run(load_config(None, ["judge.dtype=bfloat16"]), "cuda", None, ContextSpec(), bf16=False)
    assert job.resolve_run(load_config(None, []), "cuda", None, ContextSpec(), bf16=False).judge_dtype == "float16"
    share = load_config(None, [*paths, "devices=8", "gpus_per_device=0.125", "train.min_devices=2"])
    with pytest.raises(UserError, match=r"^gpus_per_device=0.125: a device's share of its GPU \(10.0 GB of 80 GB\)"):
        job.resolve_run(share, "cuda", 10e9, ContextSpec())
    with caplog.at_level("WARNING", logger="pivotrl"):
        plan = job.resolve_run(load_config(None, []), "cuda", None, ContextSpec(), vllm=False)
    assert (plan.rollout_backend, plan.judge_backend) == ("native", "native")
    assert "the native engine on CUDA, as vLLM is not installed here" in caplog.text
    assert job.resolve_run(load_config(None, []), "cuda", None, ContextSpec(), vllm=True).judge_backend == "vllm"


def test_ray_devices_say_what_the_plan_resolves_by():
    """bf16 where every device's GPU computes in it; vLLM only for devices that compute on CUDA (GPU shares a
    device's torch cannot use compute on the CPU, where auto's backend is native)."""
    from types import SimpleNamespace

    from pivotrl.runtime.devices import Binding

    def driver(*bound: tuple[str, bool]) -> SimpleNamespace:
        return SimpleNamespace(bindings=[Binding(d, d, "pg", "10.0.0.1", (str(d),), None, kind, 1, 80, bf16)
                                         for d, (kind, bf16) in enumerate(bound)])  # type: ignore[arg-type]  # fmt: skip

    assert job._bf16("cuda", driver(("cuda", True), ("cuda", True)))
    assert not job._bf16("cuda", driver(("cuda", True), ("cuda", False)))  # (the smallest capability decides)
    assert job._bf16("cpu", None)
    assert job._on_cuda("cuda", driver(("cuda", True))) and job._on_cuda("cuda", None)
    assert not job._on_cuda("cuda", driver(("cuda", True), ("cpu", True))) and not job._on_cuda("cpu", None)


def test_the_gps_holds_the_judge_once_in_the_dtype_it_is_served_in(tiny_checkpoints):
    cfg = load_config(None, [f"policy.path={tiny_checkpoints['policy']}", f"judge.path={tiny_checkpoints['judge']}"])
    for hw, dtype in ((Hardware("cuda"), "bfloat16"), (Hardware("cpu"), "float32")):
        store = LocalStore()
        plan = resolve(cfg, hw)
        job.publish_initial(store, cfg, plan)
        assert plan.judge_dtype == dtype and store.versions(JUDGE) == [0]
        assert {e.dtype for e in store.fetch(JUDGE, 0).manifest.entries} == {dtype}


@pytest.fixture
def chat_checkpoints(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """The tiny pair with chat templates in their tokenizer_config.json, as instruct models have them:
    ChatML (Qwen-style) for the policy, Llama-3-style for the judge."""
    out = {}
    for name, template in (("policy", CHATML), ("judge", LLAMA3)):
        out[name] = shutil.copytree(tiny_checkpoints[name], tmp_path / f"chat-{name}")
        file = out[name] / "tokenizer_config.json"
        file.write_text(json.dumps(json.loads(file.read_text()) | {"chat_template": template}, indent=2))
    return out


def test_policy_and_judge_read_their_prompts_in_their_chat_templates(chat_checkpoints, tmp_path, monkeypatch):
    """Both keys on: every prompt the policy encodes (rollout and evaluation) is the task's prompt in the
    policy's ChatML template, every judge prompt is in the judge's Llama-style one (its BOS written by the
    template, so none is added); the ids are those of transformers' apply_chat_template."""
    ckpt = chat_checkpoints
    encoded: list[tuple[str, bool, list[int]]] = []
    encode = Tokenizer.encode

    def recorded(self: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = encode(self, text, add_special_tokens)
        encoded.append((text, add_special_tokens, ids))
        return ids

    monkeypatch.setattr(Tokenizer, "encode", recorded)
    chats = ("task.chat_template.enabled=true", "judge.chat_template.enabled=true")
    cfg = small_job(ckpt, "steps=2", *chats, "judge.chat_template.system=You grade sums.")
    run_job(cfg, tmp_path / "run", progress=False)

    policy_chat, judge_chat = chat_templates(cfg)
    assert policy_chat is not None and judge_chat is not None
    rows = [json.loads(x) for x in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    references = {p.question: p.reference for p in read_jsonl(cfg.task.train_file)}
    heldout = read_jsonl(cfg.task.heldout_file)[: cfg.eval.size]
    prompts = [cfg.task.prompt_template.format(question=q) for q in {r["question"] for r in rows}]
    prompts += [cfg.task.prompt_template.format(question=p.question) for p in heldout]
    judged = [judge_prompt(cfg.judge.template, r["question"], references[r["question"]], r["response"]) for r in rows]
    by_text = {text: ids for text, _, ids in encoded}
    assert set(by_text) == {policy_chat(p) for p in prompts} | {judge_chat(j) for j in judged}  # nothing else, in plain
    assert not any(special for _, special, _ in encoded)  # the templates write their special tokens

    # (AutoTokenizer would pick the architecture's tokenizer class, which rebuilds this character tokenizer)
    policy_hf, judge_hf = (PreTrainedTokenizerFast.from_pretrained(ckpt[m]) for m in ("policy", "judge"))
    user = [{"role": "user", "content": prompts[0]}]
    assert by_text[policy_chat(prompts[0])] == policy_hf.apply_chat_template(
        user, add_generation_prompt=True, return_dict=False
    )
    turns = [{"role": "system", "content": "You grade sums."}, {"role": "user", "content": judged[0]}]
    expected = judge_hf.apply_chat_template(turns, add_generation_prompt=True, return_dict=False)
    assert by_text[judge_chat(judged[0])] == expected and expected.count(judge_hf.bos_token_id) == 1
    # the trained policy keeps its chat template
    assert load_chat_template(tmp_path / "run/policy", "task.chat_template").source == CHATML


@pytest.mark.parametrize("key", ["task.chat_template", "judge.chat_template"])
def test_a_chat_template_turned_on_for_a_checkpoint_without_one_stops_the_job_before_it_starts(
    key, tiny_checkpoints, tmp_path
):
    cfg = small_job(tiny_checkpoints, "steps=1", f"{key}.enabled=true")
    model = tiny_checkpoints["policy" if key.startswith("task") else "judge"]
    with pytest.raises(UserError, match=f"^{key}: {model} has no chat template .*set {key}.enabled=false"):
        run_job(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_fsdp_on_devices_sharing_a_gpu_is_refused_with_what_works():
    """NCCL takes one rank per GPU: FSDP2 cannot train devices that share one; ZeRO-1 (what ``auto`` takes there)
    and the replicated trainer can, their few collectives staged through host memory."""
    shared = ["devices=4", "gpus_per_device=0.25"]
    with pytest.raises(UserError, match="train.backend=zero or replicated"):
        context_spec(load_config(None, [*shared, "train.backend=fsdp"]), device="cuda")
    for backend in ("auto", "zero", "replicated"):
        assert context_spec(load_config(None, [*shared, f"train.backend={backend}"]), device="cuda").shared_gpu
    assert not context_spec(load_config(None, ["devices=4", "train.backend=fsdp"]), device="cuda").shared_gpu
    assert not context_spec(load_config(None, ["gpus_per_device=0.25"]), device="cuda").shared_gpu  # one device


def test_context_spec_sizes_prompts_in_their_chat_templates(chat_checkpoints):
    cfg = small_job(chat_checkpoints, "task.chat_template.enabled=true", "judge.chat_template.enabled=true")
    problems = read_jsonl(cfg.task.train_file)
    policy_chat, judge_chat = chat_templates(cfg)
    plain, chat = context_spec(cfg, problems), context_spec(cfg, problems, "cpu", policy_chat, judge_chat)
    assert not plain.policy_chat and plain.judge_chat is None
    assert chat.policy_chat and chat.judge_chat == judge_chat
    assert chat.max_len - plain.max_len == len(policy_chat("").encode())  # ChatML puts the prompt in as it is
    assert chat.judge_max_len > plain.judge_max_len


def test_a_job_whose_policy_does_not_load_writes_nothing(tiny_checkpoints, tmp_path):
    """The models are read before the run directory is touched: a failed start leaves no half-written run."""
    policy = tmp_path / "policy"
    shutil.copytree(tiny_checkpoints["policy"], policy)
    (policy / "model.safetensors").rename(policy / "pytorch_model.bin")
    cfg = small_job({**tiny_checkpoints, "policy": policy}, "steps=1")
    with pytest.raises(CheckpointError, match="only pickled weights"):
        run_job(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_resume_whose_rows_were_cut_is_refused_before_anything_is_written(tiny_checkpoints, tmp_path):
    """metrics.jsonl shorter than its checkpoint saw: refused in one line, before the devices start, and neither
    file is cut."""
    import hashlib

    cfg = small_job(tiny_checkpoints)
    run = tmp_path / "run"
    step = run / ckpt.DIR / "step_000002"
    step.mkdir(parents=True)
    state = {"step": 2, "config": cfg.to_dict(), "metrics_rows": 2, "samples_rows": 24, "entries": []}
    (step / "state.json").write_text(json.dumps(state))
    (step / "manifest.json").write_text(json.dumps({"state.json": hashlib.sha256((step / "state.json").read_bytes())
                                                    .hexdigest()}))  # fmt: skip
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "samples.jsonl").write_text('{"step": 1}\n' * 30)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ckpt.CheckpointError, match=r"cannot resume from step_000002: .*metrics.jsonl has 1 rows, "
                       "its checkpoint saw 2"):  # fmt: skip
        run_job(cfg, run, progress=False, resume=True)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_updates_that_stop_being_finite_stop_the_run_with_what_to_change(tiny_checkpoints, tmp_path):
    """A learning rate that throws the weights out of range: the first update lands, the next gradients are not
    finite and their updates are skipped; after DIVERGED_STEPS of them in a row the run stops (no resume of its
    own: it would diverge again), its steps so far written, instead of training on to a policy of NaN. (The
    random judge may give every response the fallback reward, and zero advantages move no weight: the weight
    decay moves them whatever the rewards.)"""
    from pivotrl.errors import TrainingDiverged
    from pivotrl.runtime.job import DIVERGED_STEPS

    cfg = small_job(tiny_checkpoints, "train.lr=1e30", "train.weight_decay=0.1", "steps=8", "eval.every=0")
    with pytest.raises(TrainingDiverged, match=r"training diverged: .* steps 2-4, .* lower train.lr \(now 1e\+30\)"):
        run_job(cfg, tmp_path, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 + DIVERGED_STEPS and not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize(
    ("norms", "stops"),
    [
        ([0.5, float("nan"), float("inf"), float("nan")], True),
        ([float("nan"), 0.5, float("nan"), float("nan")], False),  # one finite update between: it goes on
        ([float("nan"), float("nan")], False),
        ([0.0, 0.0, 0.0], False),  # (a step with no tokens skips its update with a norm of 0)
    ],
)
def test_divergence_is_consecutive_updates_with_a_norm_that_is_not_finite(norms, stops):
    from pivotrl.runtime.job import diverged

    rows = [{"step": i + 1, "train_grad_norm": x} for i, x in enumerate(norms)]
    assert (diverged(rows, 1e-4) is not None) == stops


def test_the_resume_hint_offers_resume_only_where_a_checkpoint_is(tmp_path):
    """``--resume`` needs a checkpoint, and ``--out`` refuses a directory that holds a run: a run stopped before
    its first checkpoint is started again elsewhere, not resumed."""
    from pivotrl import checkpoint as ckpt
    from pivotrl.runtime.job import resume_hint

    assert resume_hint(tmp_path) == f"no checkpoint yet: start it again with another --out (or remove {tmp_path} first)"
    (tmp_path / ckpt.DIR / f"{ckpt.PREFIX}000002").mkdir(parents=True)
    assert resume_hint(tmp_path) == f"resume with: pivotrl train --resume {tmp_path} (newest checkpoint: step_000002)"


def test_a_resume_replays_no_drill_of_the_run_but_runs_one_it_is_given():
    """The run's drill (fault.*) happened once, in the run resumed; a different one given to --resume runs."""
    from pivotrl.config import FaultConfig
    from pivotrl.runtime.job import resumed_drill

    ran = load_config(ROOT / "examples/default.yaml", ["fault.first=true", "fault.phase=optimizer", "fault.step=2"])
    saved = ran.to_dict()
    assert resumed_drill(ran, saved).fault == FaultConfig()  # (no drill)
    other = replace(ran, fault=replace(ran.fault, first=False, device=2, phase="judge", step=3))
    assert resumed_drill(other, saved).fault == other.fault
