import json
from pathlib import Path

from pivotrl.config import load_config
from pivotrl.control.controller import sequence_seed
from pivotrl.runtime.job import context_spec, run_job

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
            "threads_per_device=1",  # every device alike, in process or in an actor: same samples, no thread barriers
            *extra,
        ],
    )


def test_job_runs_end_to_end_and_writes_its_outputs(tiny_checkpoints, tmp_path):
    cfg = small_job(tiny_checkpoints)
    summary = run_job(cfg, tmp_path, progress=False)
    for key in ("mode", "steps", "samples_per_s", "accuracy_start", "accuracy_end", "genrm_agreement"):
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
    assert on_disk["genrm_parse_failures"] == sum(m["parse_failures"] for m in lines) > 0
    assert (tmp_path / "policy" / "model.safetensors").is_file()
    for name in ("events.jsonl", "trace.json", "timeline.png", "config.json"):
        assert (tmp_path / name).is_file(), name
    roles = {json.loads(x)["role"] for x in (tmp_path / "events.jsonl").read_text().splitlines()}
    assert roles == {"rollout", "genrm", "train", "shift"}  # evaluation is greedy generation in the rollout role
    # colocated on one device: rollout -> genrm -> train -> rollout ..., every shift loads from the GPS
    assert on_disk["shifts"] >= 3 * 3 and on_disk["shift_seconds"]["max"] > 0
    assert 0 < sum(on_disk["role_busy_fraction"].values()) <= 1.0


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
    assert {m[2] for d in decisions for m in d["moves"]} == {"rollout", "genrm", "train"}


def test_kl_to_the_initial_policy_is_trained_and_reported(tiny_checkpoints, tmp_path):
    """train.kl_coef > 0: the reference (the initial policy) is published to the GPS beside it, and every
    shift into the train role builds the frozen reference from there."""
    run_job(small_job(tiny_checkpoints, "steps=2", "train.kl_coef=0.05"), tmp_path, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("train_kl" in m and m["train_kl"] >= 0 for m in lines)


def test_context_spec_carries_the_rollout_dtype_and_kv_budget():
    cfg = load_config(None, ["policy.dtype=float32", "rollout.kv_cache_gb=2.5"])
    on_gpu, on_cpu = context_spec(cfg, device="cuda"), context_spec(cfg)
    assert (on_gpu.device, on_gpu.rollout_dtype, on_gpu.policy_dtype) == ("cuda", "bfloat16", "float32")
    assert (on_cpu.device, on_cpu.rollout_dtype) == ("cpu", "float32")
    assert on_gpu.kv_cache_bytes == on_cpu.kv_cache_bytes == 2_500_000_000
    assert context_spec(load_config(None, [])).kv_cache_bytes == 0  # auto
