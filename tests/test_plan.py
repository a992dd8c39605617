"""``pivotrl plan``: the step as the job's mode runs it, a run's measurements read with every mistake named,
and splits that never complete said so (in JSON too, which has no infinity)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pivotrl.cli import main
from pivotrl.config import load_config
from pivotrl.errors import UserError
from pivotrl.plan import format_report, plan_report

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples/default.yaml")


def report_of(*overrides: str, run_dir: Path | None = None) -> dict:
    return plan_report(load_config(CONFIG, overrides), run_dir)


def test_disaggregated_estimates_the_default_split_and_recommends_only_splits_that_train():
    """It recommended rollout:2, judge:2, train:0, which split= refuses and which cannot train."""
    report = report_of("mode=disaggregated", "devices=4")
    assert report["split"] == {"rollout": 2, "judge": 1, "train": 1} and not report["split_given"]
    assert report["timeline"]["split"] == "r2 j1 t1"
    assert min(report["recommended"].values()) >= 1
    assert report["estimates"] and all("0" not in e["split"] for e in report["estimates"])  # (r0, g0, t0)
    text = format_report(report)
    assert "split: rollout:2,judge:1,train:1 (the default; split= sets another)" in text
    assert "recommended start split" not in text


def test_disaggregated_estimates_the_split_given():
    report = report_of("mode=disaggregated", "devices=5", "split=rollout:1,judge:2,train:2")
    assert report["split"] == {"rollout": 1, "judge": 2, "train": 2} and report["split_given"]
    assert report["timeline"]["timeline"].startswith("r1 j2 t2: rollout ")
    # no device changes role: the static split is slower than the same start split in shiftable mode
    shiftable = report_of("devices=5")["estimates"]
    assert report["timeline"]["seconds"] > min(e["seconds"] for e in shiftable)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["split=rollout:2,judge:1,train:1"], "split: only used with mode=disaggregated"),
        (["mode=colocated", "split=rollout:2,judge:1,train:1"], "split: only used with mode=disaggregated"),
        (["mode=disaggregated", "devices=2"], "disaggregated mode needs at least 3 devices"),
        (["mode=disaggregated", "split=rollout:2,judge:1,train:2"], "uses 5 devices, but devices=4"),
    ],
)
def test_a_layout_train_refuses_is_refused(overrides, message, capsys):
    with pytest.raises(UserError, match=message):
        report_of(*overrides)
    assert main(["plan", CONFIG, *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_colocated_runs_every_phase_on_every_device():
    report = report_of("mode=colocated", "devices=4")
    assert "recommended" not in report and report["timeline"]["split"] == "r4 j0 t0"
    text = format_report(report)
    assert "every device generates, then judges, then trains (phases end at): rollout " in text


def test_overlapping_steps_are_said_to_be_priced_as_one_on_policy_step():
    assert "steps overlap" not in format_report(report_of())
    text = format_report(report_of("max_staleness=2"))
    assert "max_staleness=2: steps overlap, and the estimate above is of one step on-policy" in text


def test_a_split_that_never_completes_is_infeasible_not_infinitely_slow(capsys):
    report = report_of("devices=1")
    never = [e for e in report["estimates"] if e["seconds"] is None]
    assert never and all(set(e["phases"].values()) == {None} for e in never)
    json.dumps(report, allow_nan=False)  # (Infinity is not JSON)
    text = format_report(report)
    assert "r0 j0 t1: infeasible, the step never completes (no device generates)" in text
    assert "infs" not in text and "inf " not in text
    assert main(["plan", CONFIG, "devices=1", "--json"]) == 0
    assert "Infinity" not in capsys.readouterr().out


def test_the_marked_trainer_is_named_for_what_it_is(tiny_checkpoints):
    policy = f"policy.path={tiny_checkpoints['policy']}"  # (a config.json to read: models/ is built by prepare)
    assert "(* what train.backend=auto takes for this job on such GPUs)" in format_report(report_of(policy))
    text = format_report(report_of(policy, "train.backend=fsdp"))
    assert "(* train.backend=fsdp, as configured)" in text and "auto" not in text.splitlines()[-1]


def write_run(where: Path, metrics: str, events: str) -> Path:
    where.mkdir()
    (where / "metrics.jsonl").write_text(metrics)
    (where / "events.jsonl").write_text(events)
    return where


METRICS = '{"response_tokens": 400, "response_length": 20.0, "judge_tokens": 900, "time_s": {"train": 2.0}}\n'
EVENTS = '{"role": "rollout", "start": 0.0, "end": 1.0}\n{"role": "judge", "start": 1.0, "end": 2.5}\n'


@pytest.mark.parametrize(
    ("metrics", "events", "message"),
    [
        ("", EVENTS, "metrics.jsonl has no steps"),
        ("\n", EVENTS, "metrics.jsonl has no steps"),
        (
            METRICS,
            EVENTS + '{"role": "rollout", "start": 1\n',
            "events.jsonl line 3: not JSON (Expecting ',' delimiter: column 31)",
        ),
        (
            METRICS + '{"step": "1\n',
            EVENTS,
            "metrics.jsonl line 2: not JSON (Unterminated string starting at: column 10)",
        ),
        (METRICS + "[1]\n", EVENTS, "metrics.jsonl line 2: expected a JSON object, got list"),
        ('{"response_tokens": 400}\n', EVENTS, "metrics.jsonl line 1: no number at 'response_length'"),
        (METRICS, '{"start": 0.0, "end": 1.0}\n', "events.jsonl line 1: no 'role'"),
    ],
)
def test_a_profile_that_cannot_be_read_is_named_with_its_line(tmp_path, capsys, metrics, events, message):
    run = write_run(tmp_path / "run", metrics, events)
    with pytest.raises(UserError, match=re.escape(message)):
        report_of(run_dir=run)
    assert main(["plan", CONFIG, "--profile", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_profile_without_events_is_named(tmp_path):
    run = write_run(tmp_path / "run", METRICS, EVENTS)
    assert report_of(run_dir=run)["source"] == str(run)
    (run / "events.jsonl").unlink()
    with pytest.raises(UserError, match="events.jsonl not found"):
        report_of(run_dir=run)


def test_with_device_memory_the_train_devices_at_the_step_are_those_a_run_takes(tmp_path, capsys):
    """train.min_devices=auto on 80 GB devices: a 7B policy's FSDP2 state needs 3 at the step (as `train` resolves
    it), so a split with one train device is refused as `train` refuses it, the default split keeps 3, and a job
    whose devices cannot hold it at all is refused with what would help."""
    from pivotrl.model.config import ModelConfig
    from pivotrl.sim.models import MODELS

    shape: ModelConfig = MODELS["Qwen2.5-7B"].train_config()
    (tmp_path / "config.json").write_text(json.dumps(shape.to_hf("bfloat16")))
    policy = f"policy.path={tmp_path}"

    def plan(*extra: str) -> dict:
        return plan_report(load_config(CONFIG, [policy, *extra]), device_gb=80.0)

    with pytest.raises(UserError, match=r"train:1 is fewer than the 3 devices the optimizer step needs"):
        plan("mode=disaggregated", "split=rollout:2,judge:1,train:1")
    report = plan("mode=disaggregated", "devices=8")
    assert report["min_train_devices"] == 3 and report["split"]["train"] >= 3
    assert all(int(e["split"].split("t")[-1]) >= 3 for e in report["estimates"])
    with pytest.raises(UserError, match=r"min_devices=auto: .* even on all 2 devices, more than 90% of their 80 GB"):
        plan("devices=2")
    assert main(["plan", CONFIG, policy, "--device-memory-gb", "inf"]) == 2
    assert "must be a finite number > 0" in capsys.readouterr().err


def shapes(where: Path) -> list[str]:
    """``policy.path`` and ``judge.path`` of Qwen2.5-7B and Qwen2.5-32B: folders holding only their config.json
    (``pivotrl plan`` reads the architectures, no weights, no tokenizer)."""
    from pivotrl.sim.models import MODELS

    paths = []
    for key, name in (("policy", "Qwen2.5-7B"), ("judge", "Qwen2.5-32B")):
        folder = where / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(MODELS[name].train_config().to_hf("bfloat16")))
        paths.append(f"{key}.path={folder}")
    return paths


def test_plan_sizes_instances_for_a_7b_policy_and_a_32b_judge_and_prices_their_step_on_the_roofline(tmp_path, capsys):
    """On 80 GB devices the 32B judge's engine holds its batch on 2 (65.5 GB of bf16 weights alone leave one
    device's 68 GB no room for 128 judgments of 512 tokens), the 7B on 1: tensor_parallel=auto takes 2. The step is
    priced for those models on H100s (80 GB suggests it), in instances of 2, and labelled so."""
    job = [*shapes(tmp_path), "devices=8", "tensor_parallel=auto"]
    assert main(["plan", CONFIG, *job, "--device-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("devices: 8 (4 instances of 2)   mode: shiftable\nstep priced by the roofline of H100 GPUs")
    assert "for the 7.62B policy in bfloat16 and the 32.76B judge in bfloat16, instances of 2" in out
    assert (
        "  judge (32.76B in bfloat16, KV cache of 128 x 512 tokens, 8 KV heads): 2 devices: weights 32.8 + KV cache "
        "8.6 + contexts 1.5 = 42.9 GB; on 1: weights 65.5 + KV cache 17.2 + contexts 1.5 = 84.2 GB, over 68.0"
    ) in out
    assert "  rollout, the policy (7.62B in bfloat16, KV cache of 128 x 352 tokens, 4 KV heads): 1 device: " in out
    assert "  -> tensor_parallel=auto takes 2: the smallest of 1, 2, 4 (divisors of devices=8" in out
    assert "  train (zero): its state and a micro batch over the job's 8 devices 66.0 + contexts 1.5" in out
    report = plan_report(load_config(CONFIG, job), device_gb=80.0)
    assert (report["source"], report["tensor_parallel"]) == ("roofline", 2)
    assert sum(report["recommended"].values()) == 8  # (in devices, whole instances)
    assert all(sum(int(n) for n in re.findall(r"\d+", e["split"])) == 4 for e in report["estimates"])  # (instances)
    priors = plan_report(load_config(CONFIG, job))  # (no memory, no GPU: the bundled job's CPU priors)
    assert priors["source"] == "priors" and priors["tensor_parallel"] == 1
    assert priors["pricing"].startswith("the planner's CPU priors (the bundled job's")
    assert "--gpu NAME" in priors["pricing"]
    assert report["estimates"][0]["seconds"] != priors["estimates"][0]["seconds"]
    json.dumps(report, allow_nan=False)


def test_the_gpu_a_step_is_priced_on_is_named_or_suggested_by_the_memory(tmp_path, capsys):
    from pivotrl.plan import model_gpu

    assert model_gpu(None, 80).name == "H100" and model_gpu(None, 141).name == "H200"
    assert model_gpu("a100", 80).name == "A100"
    assert model_gpu(None, 40) is None and model_gpu(None, None) is None
    job = load_config(CONFIG, [*shapes(tmp_path), "devices=8", "tensor_parallel=auto"])
    alone = plan_report(job, gpu="H200")  # (its memory the devices')
    assert alone["train_memory"]["device_gb"] == 150.8 and alone["pricing"].startswith("the roofline of H200 GPUs")
    forty = plan_report(job, device_gb=40.0)["pricing"]
    assert "no modeled GPU has 40 GB: --gpu NAME (H100, H800, H200, A100)" in forty
    assert plan_report(job, device_gb=40.0, gpu="A100")["source"] == "roofline"
    assert main(["plan", CONFIG, "--gpu", "B200"]) == 2
    assert "--gpu: got 'B200'; allowed: H100, H800, H200, A100" in capsys.readouterr().err


def test_without_both_models_shapes_the_step_keeps_the_cpu_priors_and_says_why(tmp_path):
    policy = shapes(tmp_path)[0]
    report = plan_report(load_config(CONFIG, [policy, "judge.path=/nonexistent"]), device_gb=80.0)
    assert report["source"] == "priors"
    assert report["pricing"].startswith("the planner's CPU priors")
    assert "judge.path: cannot read '/nonexistent/" in report["pricing"]
    assert "  judge: not sized, judge.path: cannot read" in format_report(report)


def test_a_split_is_counted_in_whole_instances(tmp_path):
    job = [*shapes(tmp_path), "devices=8", "tensor_parallel=auto", "mode=disaggregated"]
    with pytest.raises(UserError, match=r"split: rollout:3 is not a whole number of instances of tensor_parallel=2 "):
        plan_report(load_config(CONFIG, [*job, "split=rollout:3,judge:3,train:2"]), device_gb=80.0)
    report = plan_report(load_config(CONFIG, [*job, "split=rollout:2,judge:2,train:4", "train.min_devices=4"]),
                         device_gb=80.0)  # fmt: skip
    assert report["split"] == {"rollout": 2, "judge": 2, "train": 4} and report["timeline"]["split"] == "r1 j1 t2"
