"""Simulated jobs end to end: every mode completes, writes a real run's files, and repeats exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pivotrl.cli import main
from pivotrl.config import load_config
from pivotrl.control.controller import Controller
from pivotrl.control.messages import Role
from pivotrl.errors import UserError
from pivotrl.sim.ideal import ideal_for_job, ideals_by_size
from pivotrl.sim.run import build, format_sim, format_sizes, run_simulation
from tests.sim.test_measured import PROFILE

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples/sim128.yaml")
SMALL = [
    "sim.gpus=4",
    "steps=2",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=1024",
    "eval.max_new_tokens=1024",
    "eval.size=16",
    "sim.lengths.median=200",
    "judge.max_new_tokens=256",
    "sim.judge_output_len=128",
    "sim.slice_s=2",
    "rollout.max_batch=8",  # 8 sequences per device: the work spreads, and shiftable mode migrates some
]
REAL_RUN_KEYS = {  # what run_job writes to summary.json
    "mode", "devices", "split", "steps", "samples", "samples_per_s", "steady_samples_per_s", "tokens_per_s",
    "accuracy_start", "accuracy_end", "accuracy_gain", "judge_agreement", "judge_parse_failures",
    "role_busy_fraction", "device_idle_fraction", "shifts", "migrations", "devices_lost", "migration_audit",
    "driver_wait_share", "shift_seconds",
    "wall_seconds",
    "policy_checkpoint", "gps_bytes", "train_backend", "train_min_devices",
}  # fmt: skip
FILES = ["metrics.jsonl", "summary.json", "events.jsonl", "trace.json", "timeline.png", "samples.jsonl", "config.json"]


def simulate(out: Path, *extra: str) -> dict:
    return run_simulation(load_config(EXAMPLE, [*SMALL, *extra]), out)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for mode in ("colocated", "disaggregated", "shiftable"):
        out[mode] = tmp_path_factory.mktemp(mode)
        simulate(out[mode], f"mode={mode}")
    return out


@pytest.mark.parametrize("mode", ["colocated", "disaggregated", "shiftable"])
def test_every_mode_completes_and_writes_a_runs_files(runs, mode):
    run = runs[mode]
    for name in FILES + (["decisions.jsonl"] if mode == "shiftable" else []):
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == mode and summary["devices"] == 4 and summary["steps"] == 2
    assert summary["sim_seconds"] > 0 and 0 < summary["wall_seconds"] < 30
    assert summary["judge_parse_failures"] == 0 and summary["judge_agreement"] == 1.0
    metrics = rows(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["step_seconds"] > 0 for m in metrics)
    samples = rows(run / "samples.jsonl")
    assert len(samples) == 2 * 8 * 4
    assert all(r["judge_tokens"] > 0 for r in samples)  # every sample judged, its judgment's length kept
    roles = {e["role"] for e in rows(run / "events.jsonl")}
    assert {"rollout", "judge", "train", "shift"} <= roles
    trace = json.loads((run / "trace.json").read_text())
    assert {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"} == {
        f"device {d}" for d in range(4)
    }
    assert (run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_has_a_real_runs_keys_plus_virtual_and_real_time(runs):
    summary = json.loads((runs["colocated"] / "summary.json").read_text())
    assert REAL_RUN_KEYS | {"sim_seconds", "sim", "wall_split"} == set(summary)
    assert summary["samples_per_s"] == pytest.approx(2 * 32 / summary["sim_seconds"])
    assert summary["train_backend"] in ("zero", "fsdp") and summary["train_min_devices"] >= 1  # (the trainer priced)


def test_the_same_config_gives_the_same_run(runs, tmp_path):
    simulate(tmp_path, "mode=shiftable")
    a = json.loads((runs["shiftable"] / "summary.json").read_text())
    b = json.loads((tmp_path / "summary.json").read_text())
    for key in ("wall_seconds", "wall_split"):  # real time
        a.pop(key), b.pop(key)
    assert a == b
    for name in ("metrics.jsonl", "samples.jsonl", "events.jsonl", "decisions.jsonl"):
        assert (runs["shiftable"] / name).read_text() == (tmp_path / name).read_text(), name


def test_placement_never_changes_what_is_sampled(runs):
    """Lengths and verdicts are fixed per sequence: every mode sees the same samples, migrated or not."""
    samples = {m: rows(runs[m] / "samples.jsonl") for m in runs}
    key = [(r["step"], r["uid"], r["response_tokens"], r["reward"]) for r in samples["colocated"]]
    for m in ("disaggregated", "shiftable"):
        assert [(r["step"], r["uid"], r["response_tokens"], r["reward"]) for r in samples[m]] == key
    assert sum(r["migrations"] for r in samples["shiftable"]) > 0


def test_the_simulated_trainer_is_the_one_the_runtime_would_run():
    """On modeled GPUs ``auto`` is FSDP2 (backward in lockstep at the step); a measured CPU profile's runtime
    trains replicated (each group as it comes); zero and replicated never wait for the step."""
    assert build(load_config(None, ["sim.gpus=2"])).spec.lockstep_train
    assert build(load_config(None, ["sim.gpus=2"])).loop.lockstep_train
    for backend in ("zero", "replicated"):
        assert not build(load_config(None, ["sim.gpus=2", f"train.backend={backend}"])).spec.lockstep_train


def test_the_simulated_judge_is_priced_in_the_dtype_a_run_serves_it_in():
    """judge.dtype=auto is bf16 on the modeled GPUs, as the runtime resolves it; one given is priced as given."""
    assert build(load_config(None, ["sim.gpus=2"])).spec.genrm.dtype_bytes == 2
    assert build(load_config(None, ["sim.gpus=2", "judge.dtype=float32"])).spec.genrm.dtype_bytes == 4


def test_every_optimizer_step_runs_on_the_train_devices_it_needs(tmp_path):
    """train.min_devices=4 on 4 simulated instances: the planner brings every one of them to each step."""
    simulate(tmp_path / "run", "mode=shiftable", "train.min_devices=4", "train.backend=zero")
    assert [m["train_world_size"] for m in rows(tmp_path / "run" / "metrics.jsonl")] == [4.0, 4.0]


def test_the_optimizer_step_waits_for_as_many_instances_as_the_trainer_fits_on(caplog):
    """train.min_devices=auto as a run resolves it on the modeled GPUs: Qwen2.5-7B's ZeRO-1 state and a micro
    batch fit on 5 H100s, so the step needs 5 instances of one GPU and 2 of four; given, it is as given. A
    trainer whose state fits on none (ZeRO-1 keeps 6 bytes a parameter whole: 88 GB for Qwen2.5-14B) is
    priced anyway, as a what-if, with a warning that names what a run would meet."""
    from pivotrl.log import logger

    def needed(*extra: str) -> int:
        return build(load_config(EXAMPLE, ["train.backend=zero", *extra])).loop.min_train_devices

    assert needed() == 5 and needed("sim.instance_gpus=4") == 2 and needed("train.min_devices=3") == 3
    if not logger.propagate:
        logger.addHandler(caplog.handler)
    try:
        assert needed("sim.policy_model=Qwen2.5-14B", "sim.judge_model=Qwen2.5-14B") == 1
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and warned[0].startswith("training 14.77B parameters with train.backend=zero needs")
        assert "needs 103 GB a device even on all 128 devices" in warned[0] and "a run would not fit it" in warned[0]
        caplog.clear()  # the job's ideals (a simulate prints them) build it again, quietly: said once is enough
        ideals_by_size(load_config(EXAMPLE, ["train.backend=zero", "sim.policy_model=Qwen2.5-14B"]))
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        assert needed("sim.policy_model=Qwen2.5-14B", "sim.judge_model=Qwen2.5-14B", "train.backend=fsdp") > 1
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
    finally:
        logger.removeHandler(caplog.handler)


def test_the_simulated_trainer_checkpoints_activations_where_a_gpu_would():
    """train.activation_checkpointing=auto as a device resolves it: Qwen2.5-7B's 16k-token micro batches need
    about 100 GB of activations unchecked, more than an H100 holds beside the trainer, so each layer's forward runs
    again in the backward (4 forward passes a token, not 3); a 1.5B policy's fit; false is false."""
    forwards = {}
    for name, extra in (("7b", []), ("1.5b", ["sim.policy_model=Qwen2.5-1.5B"]),
                        ("off", ["train.activation_checkpointing=false"])):  # fmt: skip
        costs = build(load_config(EXAMPLE, extra)).spec.costs
        forwards[name] = costs.train_forwards
    assert forwards == {"7b": 4.0, "1.5b": 3.0, "off": 3.0}
    spec = build(load_config(EXAMPLE, [])).spec
    plain = build(load_config(EXAMPLE, ["train.activation_checkpointing=false"])).spec
    model = spec.policy
    assert spec.costs.train_tokens(model, 8192, 4) == pytest.approx(4 / 3 * plain.costs.train_tokens(model, 8192, 4))


def test_the_summary_says_training_is_priced_with_checkpointing(runs):
    summary = json.loads((runs["colocated"] / "summary.json").read_text())
    assert summary["sim"]["train_forwards"] == 4.0
    assert "training with activation checkpointing (4 forward passes a token)" in format_sim(summary)


def test_measured_costs_drive_a_simulation(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(PROFILE))
    s = simulate(tmp_path / "run", f"sim.costs={costs}", "mode=colocated", "rollout.max_new_tokens=64",
                 "eval.max_new_tokens=64", "judge.max_new_tokens=64", "sim.judge_output_len=32", "sim.prompt_len=64",
                 "rollout.max_batch=32")  # fmt: skip
    assert s["shifts"] > 0 and 0 < s["shift_seconds"]["max"] <= max(PROFILE["shift"].values())
    sized = [f"sim.costs={costs}", "rollout.max_new_tokens=64", "eval.max_new_tokens=64", "judge.max_new_tokens=64",
             "sim.prompt_len=64", "rollout.max_batch=32"]  # fmt: skip
    assert not build(load_config(None, sized)).spec.lockstep_train  # (a CPU runtime's auto trains replicated)


@pytest.mark.parametrize(
    "args, message",
    [
        (["sim.gpu=B200"], "sim.gpu: expected one of H100, H800, H200, A100, got 'B200'"),
        (["sim.gpus=100", "tensor_parallel=8"], "sim.gpus: expected a multiple of tensor_parallel (8), got 100"),
        (["sim.gpus=100", "sim.instance_gpus=8"], "sim.gpus: expected a multiple of tensor_parallel (8), got 100"),
        (["sim.lengths.kind=zipf"], "sim.lengths.kind: must be one of fixed, uniform, lognormal, pareto"),
        (["sim.lengths.sigma=-1"], "sim.lengths.sigma: got -1.0, must be a finite number >= 0"),
        (["sim.gpsu=8"], "unknown key 'sim.gpsu'"),
        (["sim.yes_probability=2"], "sim.yes_probability: expected a number in [0, 1], got 2"),
        (["sim.costs=/nonexistent.json"], "sim.costs: expected 'roofline', 'deployed' or a measured-costs JSON file"),
        (["sim.lengths_file=/nonexistent.jsonl"], "sim.lengths_file: file '/nonexistent.jsonl' not found"),
        (["sim.group_correlation=1.5"], "sim.group_correlation: expected a number in [0, 1], got 1.5"),
        (["sim.lengths_replay=true"], "sim.lengths_replay: needs a trace to replay (sim.lengths_file)"),
        (["sim.policy_model=Qwen3-235B-A22B"], "tensor_parallel: Qwen3-235B-A22B with"),
        (["tensor_parallel=8"], "tensor_parallel=8: the policy's num_attention_heads=28 cannot be cut in 8 parts"),
        (["tensor_parallel=16"], "tensor_parallel: 16 GPUs an instance, more than a node of H100s holds (8)"),
        (["tensor_parallel=4", "rollout.backend=native"], "tensor_parallel=4: rollout.backend=native serves one"),
        (["mode=disaggregated", "split=rollout:2,judge:1,train:1"], "uses 4 devices, but devices=128"),
        (["sim.instance_gpus=4", "sim.rollout_engine_gpus=3"], "sim.rollout_engine_gpus: expected 0 (one engine"),
        (["sim.elastic_engines=3"], "sim.elastic_engines: expected true or false, got 3"),
        (["sim.shift_scale=-1"], "sim.shift_scale: expected a number >= 0 (1: the modeled cost, 0: free), got -1"),
        (["sim.migration_scale=inf"], "sim.migration_scale: expected a number >= 0 (1: the modeled cost, 0: free)"),
    ],
)
def test_a_bad_sim_setting_exits_2_with_one_line(args, message, capsys, tmp_path):
    assert main(["simulate", EXAMPLE, *args, "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_cli_prints_the_summary_and_virtual_time(capsys, tmp_path):
    assert main(["simulate", EXAMPLE, *SMALL, "mode=colocated", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "colocated on 4 device(s), 2 steps" in out and "timeline:" in out
    assert "on 4 x H100 (4 instances of 1 GPU)" in out and "s of wall time" in out
    assert "no schedule's step is shorter than" in out


def test_the_cli_names_an_instance_size_whose_floor_allows_more(tmp_path, capsys):
    """The bundled 128-GPU job's steps wait on their longest responses: its floor is lower on instances of
    4 GPUs than of 1 (``ideals_by_size``), so at 1 the size to try is 4; at 4 nothing faster is named."""
    assert "try tensor_parallel=4" in format_sizes(load_config(EXAMPLE, []))
    assert format_sizes(load_config(EXAMPLE, ["sim.instance_gpus=4"])) is None
    assert main(["simulate", EXAMPLE, "steps=1", "eval.size=16", "--out", str(tmp_path / "run")]) == 0
    assert "try tensor_parallel=4" in capsys.readouterr().out
    assert main(["simulate", EXAMPLE, "steps=1", "eval.size=16", "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert "try tensor_parallel" not in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["colocated", "shiftable"])
def test_a_simulated_run_says_how_far_it_is_from_any_schedule(runs, mode):
    summary = json.loads((runs[mode] / "summary.json").read_text())
    bounds = summary["sim"]["ideal"]
    cfg = load_config(EXAMPLE, [*SMALL, f"mode={mode}"])
    ideal = ideal_for_job(cfg)
    assert bounds["samples_per_s"] == pytest.approx(ideal.samples_per_s)
    assert bounds["floor_seconds"] == pytest.approx(ideal.floor_seconds)
    assert bounds["floor_samples_per_s"] == pytest.approx(ideal.samples / ideal.floor_seconds)
    assert (
        0 < bounds["steady_of_floor"] == pytest.approx(summary["steady_samples_per_s"] / bounds["floor_samples_per_s"])
    )
    assert bounds["steady_of_floor"] < 1  # no run beats the floor
    assert "lockstep_floor_seconds" not in bounds and "backpropagates at the step" not in format_sim(summary)


def test_a_simulated_fsdp2_run_says_how_far_it_is_from_its_trainers_floor(tmp_path):
    # FSDP2 backpropagates every group after the last judgment: a floor of its own, above every schedule's
    summary = simulate(tmp_path / "run", "mode=shiftable", "train.backend=fsdp")
    bounds = summary["sim"]["ideal"]
    ideal = ideal_for_job(load_config(EXAMPLE, [*SMALL, "mode=shiftable", "train.backend=fsdp"]))
    assert bounds["lockstep_floor_seconds"] == pytest.approx(ideal.lockstep_floor_s)
    held = ideal.samples / ideal.lockstep_floor_s
    assert bounds["steady_of_lockstep_floor"] == pytest.approx(summary["steady_samples_per_s"] / held)
    assert 0 < bounds["steady_of_lockstep_floor"] < 1  # no run of that trainer beats its floor
    assert "with a trainer that backpropagates at the step (train.backend=fsdp) none is shorter than" in format_sim(
        summary
    )


def test_a_trace_replays_each_samples_length_by_step_and_uid(tmp_path):
    """Replayed, a run's lengths come back per sample (a group's together, as the run had them);
    a sample the trace lacks gets a drawn length."""
    trace = tmp_path / "lengths.jsonl"
    table = {(step, uid): 10 + 7 * uid + step for step in (1, 2) for uid in range(32) if (step, uid) != (2, 5)}
    trace.write_text("".join(json.dumps({"step": s, "uid": u, "length": n}) + "\n" for (s, u), n in table.items()))
    simulate(tmp_path / "run", f"sim.lengths_file={trace}", "sim.lengths_replay=true", "mode=shiftable")
    got = {(r["step"], r["uid"]): r["response_tokens"] for r in rows(tmp_path / "run/samples.jsonl")}
    assert len(got) == 64 and {k: v for k, v in got.items() if k != (2, 5)} == table
    assert got[(2, 5)] in {n for n in table.values()}  # drawn from the trace
    bad = tmp_path / "plain.jsonl"
    bad.write_text("12\n40\n")
    assert main(["simulate", EXAMPLE, *SMALL, f"sim.lengths_file={bad}", "sim.lengths_replay=true",
                 "--out", str(tmp_path / "bad"), "--quiet"]) == 2  # fmt: skip


@pytest.mark.parametrize("rho", [0.0, 1.0])
def test_group_correlation_ties_the_lengths_of_a_groups_responses(tmp_path, rho):
    simulate(tmp_path / "run", f"sim.group_correlation={rho}", "mode=colocated")
    groups: dict[tuple[int, int], set[int]] = {}
    for r in rows(tmp_path / "run/samples.jsonl"):
        groups.setdefault((r["step"], r["uid"] // 4), set()).add(r["response_tokens"])
    alike = sum(len(g) == 1 for g in groups.values())
    assert alike == len(groups) if rho == 1 else alike == 0


def test_lengths_from_a_trace_file(tmp_path):
    trace = tmp_path / "lengths.jsonl"
    trace.write_text("\n".join(str(n) for n in (50, 60, 70, 2000)) + "\n")
    simulate(tmp_path / "run", f"sim.lengths_file={trace}", "mode=colocated")
    lengths = {r["response_tokens"] for r in rows(tmp_path / "run/samples.jsonl")}
    assert lengths <= {50, 60, 70, 1024} and len(lengths) > 1


def test_compare_reads_simulated_runs(runs):
    from pivotrl.compare import compare_runs

    c = compare_runs(runs["colocated"], runs["shiftable"])
    assert c.samples == 2 * 32 and c.token_match == 1.0 and c.reward_match == 1.0


@pytest.mark.parametrize("mode", ["colocated", "shiftable"])
def test_the_pump_looking_at_touched_devices_decides_as_one_looking_at_all(tmp_path, monkeypatch, mode):
    """The controller's pump passes over every device only when the targets or the policy version
    changed, otherwise over those that had an event or a command: each run's commands, in order, and
    its timeline must be what a pump looking at every device every time gives."""
    from pivotrl.control import controller as control
    from pivotrl.sim import run as sim_run

    class Sent(control.Controller):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.sent: list = []

        def pump(self):
            cmds = super().pump()
            self.sent += cmds
            return cmds

    class EveryDevice(Sent):
        def pump(self):
            self.fleet.look_again()  # as if the targets had changed: every device is looked at
            return super().pump()

    seen = {}
    for name, cls in (("touched", Sent), ("every", EveryDevice)):
        made = []
        monkeypatch.setattr(sim_run, "Controller", lambda *a, cls=cls, made=made: made.append(cls(*a)) or made[-1])
        summary = simulate(tmp_path / name, f"mode={mode}", "sim.gpus=40", "rollout.prompts_per_step=40")
        seen[name] = (made[0].sent, (tmp_path / name / "events.jsonl").read_text(), summary["sim_seconds"])
    assert seen["touched"] == seen["every"]
    assert len(seen["every"][0]) > 100 and sum(type(c).__name__ == "Shift" for c in seen["every"][0]) > 40


def test_a_full_paged_cache_preempts_and_loses_no_sample(tmp_path):
    # Qwen2.5-32B on one A100 keeps ~47k tokens of KV: 32 responses of up to 8,192 tokens overflow it
    job = ["sim.gpus=1", "sim.gpu=A100", "sim.policy_model=Qwen2.5-32B", "sim.judge_model=Qwen2.5-1.5B",
           "rollout.max_new_tokens=8192", "eval.max_new_tokens=8192", "sim.lengths.median=3000",
           "rollout.max_batch=64", "mode=colocated"]  # fmt: skip
    paged = simulate(tmp_path / "paged", *job)
    reserved = simulate(tmp_path / "reserved", *job, "sim.kv_cache=reserved")
    assert paged["sim"]["kv_cache"] == "paged" and paged["sim"]["preemptions"] > 0
    assert reserved["sim"]["preemptions"] == 0
    assert paged["samples"] == reserved["samples"] == 2 * 8 * 4
    assert rows(tmp_path / "paged" / "samples.jsonl") == rows(tmp_path / "reserved" / "samples.jsonl")


def test_spread_judgments_cut_at_the_cap_are_warned_about(caplog):
    """sigma 0.9 about 128 tokens under a 256-token cap: about a fifth of the judgments lose their verdict."""
    from pivotrl.log import logger
    from pivotrl.sim.run import build

    if not logger.propagate:  # the CLI's logging setup stops records reaching the root's handler
        logger.addHandler(caplog.handler)
    try:
        build(load_config(EXAMPLE, [*SMALL, "sim.judge_output_sigma=0.9"]))

        def warned() -> list[str]:  # (the trainer's state does not fit 4 GPUs either: another warning)
            return [m for r in caplog.records if r.levelname == "WARNING" and "judgments" in (m := r.getMessage())]

        assert len(warned()) == 1 and "22% of judgments reach judge.max_new_tokens (256, 2.0x" in warned()[0]
        caplog.clear()
        build(load_config(EXAMPLE, [*SMALL, "sim.judge_output_sigma=0.9", "judge.max_new_tokens=1024"]))
        build(load_config(EXAMPLE, SMALL))  # judgments of one length below the cap: nothing to say
        assert not warned()
    finally:
        logger.removeHandler(caplog.handler)


@pytest.mark.parametrize(("cache", "paged"), [("paged", True), ("reserved", False)])
def test_the_judges_paged_cache_reaches_the_scheduler_and_the_planner(cache, paged):
    """A judge device is handed what its KV cache holds, and the planner prices judgments at the batches it
    allows: both take the judge instances' cache from the simulator (none where sequences reserve slots)."""
    sim = build(load_config(EXAMPLE, ["mode=shiftable", f"sim.kv_cache={cache}"]))
    kv = sim.spec.kv_tokens(Role.JUDGE)
    assert (kv is not None) is paged
    assert sim.loop.judge_kv == (kv or 0) and sim.policy.judge_kv == kv
    ctl = Controller(sim.loop, sim.policy, sim.genrm, sim.train_set, sim.heldout, lambda: 0.0)
    assert ctl.scheduler.judge_kv == (kv if paged else math.inf)


def test_the_deployed_colocated_baseline_pays_its_switches_and_moves_no_sequence(runs, tmp_path):
    summary = simulate(tmp_path, "mode=colocated", "sim.costs=deployed", "rollout.rebalance=false", "sim.gpus=8",
                       "sim.instance_gpus=2")  # fmt: skip
    assert summary["sim"]["costs"] == "deployed" and "deployed frameworks' published costs" in format_sim(summary)
    strong = tmp_path / "strong"
    simulate(strong, "mode=colocated", "sim.gpus=8", "sim.instance_gpus=2")
    deployed, ours = rows(tmp_path / "metrics.jsonl"), rows(strong / "metrics.jsonl")
    # every step syncs the new weights into the woken rollout engine: seconds more than pivotrl's loads
    assert all(d["shift_seconds"] > o["shift_seconds"] for d, o in zip(deployed, ours, strict=True))
    assert sum(d["migrations"] for d in deployed) == 0
    assert json.loads((tmp_path / "config.json").read_text())["sim"]["costs"] == "deployed"


def test_free_shifts_and_migrations_are_a_what_if_that_costs_nothing_else(runs, tmp_path):
    """``sim.shift_scale=0 sim.migration_scale=0``: every shift takes no time and the run says it is a what-if;
    the samples are those of the run as modeled (placement never changes what is sampled)."""
    summary = simulate(tmp_path, "mode=shiftable", "sim.shift_scale=0", "sim.migration_scale=0")
    modeled = json.loads((runs["shiftable"] / "summary.json").read_text())
    assert summary["shifts"] > 0 and modeled["shift_seconds"]["max"] > 0
    assert summary["shift_seconds"] == {"mean": 0.0, "max": 0.0}
    assert summary["sim"]["shift_scale"] == 0 and summary["sim"]["migration_scale"] == 0
    assert "shifts free and migrations free (a what-if)" in format_sim(summary)
    assert "what-if" not in format_sim(modeled)
    free, as_modeled = rows(tmp_path / "samples.jsonl"), rows(runs["shiftable"] / "samples.jsonl")
    key = [(r["step"], r["uid"], r["response_tokens"], r["reward"]) for r in as_modeled]
    assert [(r["step"], r["uid"], r["response_tokens"], r["reward"]) for r in free] == key
    half = simulate(tmp_path / "half", "mode=shiftable", "sim.shift_scale=0.5")
    assert "shifts at 0.5x their cost (a what-if)" in format_sim(half)


def test_tensor_parallel_is_the_instance_size_the_simulator_models(tmp_path):
    """The job's key, as a simulated job loads it or as a run's config names it (devices its GPUs), models the
    same instances as the simulator's older key; its written config reloads to them."""
    spec = build(load_config(EXAMPLE, [*SMALL, "sim.gpus=8", "tensor_parallel=4"], simulated=True)).spec
    older = build(load_config(EXAMPLE, [*SMALL, "sim.gpus=8", "sim.instance_gpus=4"])).spec
    as_run = build(load_config(EXAMPLE, [*SMALL, "sim.gpus=8", "devices=8", "tensor_parallel=4"])).spec
    assert (spec.tp, spec.devices) == (older.tp, older.devices) == (as_run.tp, as_run.devices) == (4, 2)
    with pytest.raises(UserError, match="tensor_parallel: 4 and sim.instance_gpus: 2 both name the instance size"):
        build(load_config(EXAMPLE, [*SMALL, "sim.gpus=8", "devices=8", "tensor_parallel=4", "sim.instance_gpus=2"]))
    assert main(["simulate", EXAMPLE, *SMALL, "sim.gpus=8", "tensor_parallel=2", "mode=colocated", "steps=1",
                 "--out", str(tmp_path), "--quiet"]) == 0  # fmt: skip
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["tensor_parallel"], written["devices"], written["sim"]["instance_gpus"]) == (1, 4, 2)
    assert load_config(tmp_path / "config.json", simulated=True).sim.instance_gpus == 2


def test_auto_tensor_parallel_resolves_on_the_modeled_gpus_memory():
    """The fewest GPUs (a divisor of the cluster's) that hold each model's batch, or where none does, its weights
    and a sequence: a 235B judge needs 8 H100s of 80 GB, 4 H200s of 141 GB."""
    job = ["sim.gpus=16", "tensor_parallel=auto", "sim.judge_model=Qwen3-235B-A22B", "sim.policy_model=Qwen2.5-14B"]
    assert build(load_config(EXAMPLE, job, simulated=True)).spec.tp == 8
    assert build(load_config(EXAMPLE, [*job, "sim.gpu=H200"], simulated=True)).spec.tp == 4
    # (a 7B pair: on one GPU, but its batch of 256 sequences of 9k tokens holds 125 GB of KV cache, on 4 a quarter)
    assert build(load_config(EXAMPLE, ["tensor_parallel=auto"], simulated=True)).spec.tp == 4
