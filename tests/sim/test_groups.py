"""The model groups: their job files, the overrides that size them, and the sensitivity sweep's points."""

from __future__ import annotations

import pytest

from pivotrl.config import load_config
from pivotrl.sim.groups import (
    BASE,
    GROUPS,
    instance_sizes,
    job_overrides,
    reasoning_points,
    sweep_points,
    tail_points,
    unbuilt_sizes,
    with_tp,
)


def test_tail_points_keep_the_mean_length():
    means = {}
    for label, extra in tail_points():
        cfg = load_config(BASE, extra)
        means[label] = cfg.sim.lengths.dist(cfg.rollout.max_new_tokens).mean()
    assert list(means)[0] == "uniform" and list(means)[-1].startswith("pareto")
    base = means["lognormal s=0.9"]
    assert all(m == pytest.approx(base, rel=0.01) for m in means.values()), means


def test_reasoning_points_spread_the_judgments_and_leave_about_one_percent_at_the_cap():
    for label, extra in reasoning_points():
        cfg = load_config(BASE, extra)
        dist = cfg.sim.judge_lengths(cfg.judge.max_new_tokens)
        capped = sum(dist.quantile((i + 0.5) / 1000) >= dist.cap for i in range(1000)) / 1000
        assert cfg.sim.judge_output_sigma > 0 and 0.002 < capped < 0.02, (label, capped)
        assert dist.quantile(0.5) == cfg.sim.judge_output_len


def test_with_tp_replaces_the_instance_size():
    base = job_overrides(GROUPS["judge-32b"], 128, 2)
    out = with_tp(base, 4)
    assert "tensor_parallel=4" in out and "tensor_parallel=2" not in out and len(out) == len(base)
    assert GROUPS["judge-32b"].job(out).sim.instance_gpus == 4
    # overrides that name the size by its older name (a report's) take the new one
    older = with_tp([o.replace("tensor_parallel=", "sim.instance_gpus=") for o in base], 4)
    assert older == out


# each group as examples/sim128.yaml ran it with the group's models and settings on the command line
OVERRIDES = {
    "dense-7b": ["sim.policy_model=Qwen2.5-7B", "sim.judge_model=Qwen2.5-7B", "train.backend=zero"],
    "moe-30b": ["sim.policy_model=Qwen3-30B-A3B", "sim.judge_model=Qwen3-30B-A3B", "train.backend=fsdp"],
    "judge-32b": ["sim.policy_model=Qwen2.5-7B", "sim.judge_model=Qwen2.5-32B", "train.backend=zero"],
    "dense-14b": ["sim.policy_model=Qwen2.5-14B", "sim.judge_model=Qwen2.5-14B", "train.backend=fsdp"],
    "reasoning-judge": ["sim.policy_model=Qwen2.5-7B", "sim.judge_model=Qwen2.5-14B", "train.backend=zero",
                        "sim.judge_output_len=1024", "sim.judge_output_sigma=0.8", "judge.max_new_tokens=8192"],
    "long-rollout": ["sim.policy_model=Qwen2.5-7B", "sim.judge_model=Qwen2.5-7B", "train.backend=zero",
                     "sim.lengths.median=2400", "rollout.max_new_tokens=16384", "eval.max_new_tokens=16384"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(GROUPS))
def test_each_job_file_is_the_shared_workload_with_its_groups_models_and_trainer(name):
    group = GROUPS[name]
    for gpus, tp in ((128, 1), (128, 4), (32, 2)):
        base = load_config(BASE, [*OVERRIDES[name], "eval.size=16", f"sim.gpus={gpus}", f"sim.instance_gpus={tp}"])
        assert group.job(job_overrides(group, gpus, tp)) == base
    # the job file names the size the shiftable mode runs at; the other benchmarks run the group there
    assert group.instance_gpus == 4 and group.job().sim.gpus == 128
    assert job_overrides(group, 128, 4)[2] == next(o for o in OVERRIDES[name] if o.startswith("train.backend="))


def test_the_sweep_varies_dense_7b_one_axis_at_a_time():
    points = sweep_points(128, [32, 128, 512], ("judge", "cluster"))
    assert [(axis, label) for axis, label, _, _ in points] == [
        ("judge size", "1.5B"), ("judge size", "14B"), ("judge size", "32B"), ("cluster", "32 GPUs"),
        ("cluster", "512 GPUs")]  # fmt: skip
    judge = points[0][2]
    assert judge.policy == "Qwen2.5-7B" and judge.genrm == "Qwen2.5-1.5B"
    assert judge.job(job_overrides(judge, 128, 1)).sim.judge_model == "Qwen2.5-1.5B"
    assert [gpus for *_, gpus in points] == [128, 128, 128, 32, 512]
    assert len(sweep_points(128, [128], ("tail", "reasoning", "cluster"))) == len(tail_points()) + 2


def test_the_groups_run_only_layouts_the_runtime_builds():
    """A 7B model's 28 attention heads cut in 1, 2 or 4 but not 8: its groups' table leaves out instances of 8
    GPUs and says why; the 14B pair (40 heads, 8 KV heads) and the MoE pair (32, 4) cut in 8."""
    assert sorted(instance_sizes(GROUPS["dense-7b"], 128)) == [1, 2, 4]
    unbuilt = unbuilt_sizes(GROUPS["dense-7b"], 128)
    assert list(unbuilt) == ["8"] and "num_attention_heads=28 cannot be cut in 8 parts" in unbuilt["8"]
    assert unbuilt_sizes(GROUPS["dense-14b"], 128) == unbuilt_sizes(GROUPS["moe-30b"], 128) == {}
