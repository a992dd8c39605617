import copy
import json
import statistics
from pathlib import Path

import pytest

from pivotrl.cli import main
from pivotrl.config import load_config
from pivotrl.control.messages import Role
from pivotrl.errors import UserError
from pivotrl.sim.costs import SPREAD_KINDS, CostModel
from pivotrl.sim.measured import REQUIRED_SHIFTS, MeasuredCosts, fit_run, nonneg_least_squares
from pivotrl.sim.models import ModelSpec
from pivotrl.sim.run import run_simulation
from pivotrl.sim.workload import replay_table

POLICY = ModelSpec("policy", 1e6, 1e6, 2, 64, 4, 2, 16, 100, True)
GENRM = ModelSpec("judge", 2e6, 2e6, 2, 64, 4, 2, 16, 100, True)
GEN = {"step_base_s": 0.004, "step_per_seq_s": 2e-4, "step_per_kv_token_s": 1e-7, "prefill_per_token_s": 5e-5}
PROFILE = {
    "device": "cpu, 1 torch thread",
    "rollout": {"model": "policy", **GEN, "max_batch": 64, "max_len": 256},
    "judge": {"model": "judge", **GEN, "step_base_s": 0.006, "max_batch": 32, "max_len": 512},
    "train": {"per_token_s": 3e-4, "optimizer_step_s": 0.05},
    "shift": {key: 0.1 * (i + 1) for i, key in enumerate(REQUIRED_SHIFTS)},
}


def costs(**changes) -> MeasuredCosts:
    return MeasuredCosts.from_dict({**copy.deepcopy(PROFILE), **changes})


def test_round_trips_through_a_dict_and_a_file(tmp_path):
    c = costs()
    assert isinstance(c, CostModel)
    assert c.to_dict() == PROFILE
    assert MeasuredCosts.from_dict(c.to_dict()) == c
    c.save(tmp_path / "costs.json")
    assert MeasuredCosts.load(tmp_path / "costs.json") == c


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (("rollout", "step_per_seq_s"), "rollout.step_per_seq_s: missing key"),
        (("train", "optimizer_step_s"), "train.optimizer_step_s: missing key"),
        (("shift", "judge->train"), "shift.judge->train: missing key"),
        (("judge",), "judge: missing key"),
    ],
)
def test_a_missing_key_is_named(path, message):
    data = copy.deepcopy(PROFILE)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    with pytest.raises(ValueError, match=message):
        MeasuredCosts.from_dict(data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rollout": {**PROFILE["rollout"], "step_base_s": -1}}, "rollout.step_base_s: got -1"),
        ({"rollout": {**PROFILE["rollout"], "max_batch": 0.5}}, "rollout.max_batch: got 0.5, must be an int"),
        ({"rollout": {**PROFILE["rollout"], "tp": 2}}, "rollout.tp: unknown key"),
        ({"shift": {**PROFILE["shift"], "train->train": 1.0}}, "shift.train->train: unknown key"),
        ({"judge": {**PROFILE["judge"], "model": "policy"}}, "must differ"),
        ({"extra": 1}, "extra: unknown key"),
    ],
)
def test_a_bad_value_is_named(change, message):
    with pytest.raises(ValueError, match=message):
        costs(**change)


def test_load_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"rollout": {}}')
    with pytest.raises(ValueError, match="bad.json: judge: missing key"):
        MeasuredCosts.load(path)


def test_roles_are_told_apart_by_model_name():
    c = costs()
    assert c.decode_step(POLICY, 1, 10, 100) == pytest.approx(0.004 + 10 * 2e-4 + 1e-7 * 10 * 100)
    assert c.decode_step(GENRM, 1, 10, 100) == pytest.approx(0.006 + 10 * 2e-4 + 1e-7 * 10 * 100)
    assert c.max_batch(POLICY, 1, 256) == 64 and c.max_batch(POLICY, 1, 257) == 0
    assert c.max_batch(GENRM, 1, 512) == 32
    with pytest.raises(ValueError, match="'other' was not measured"):
        c.decode_step(ModelSpec("other", 1e6, 1e6, 2, 64, 4, 2, 16, 100, True), 1, 1, 1)
    with pytest.raises(ValueError, match="tp: got 2"):
        c.decode_step(POLICY, 2, 1, 1)


def test_decode_span_sums_the_steps():
    c = costs()
    loop = sum(c.decode_step(POLICY, 1, 7, 50 + i) for i in range(40))
    assert c.decode_span(POLICY, 1, 7, 50, 40) == pytest.approx(loop)


def test_training_prefill_and_migration():
    c = costs()
    assert c.train_tokens(POLICY, 1000, 4) == pytest.approx(1000 * 3e-4 / 4)
    assert c.optimizer_step(POLICY, 4) == 0.05
    assert c.prefill(POLICY, 1, 100) == c.migration(POLICY, 1, 100) == pytest.approx(100 * 5e-5)
    with pytest.raises(ValueError, match="only the policy"):
        c.train_tokens(GENRM, 1000, 4)


def test_shifts_by_role_pair_and_first_loads():
    c = costs()
    assert c.shift(POLICY, Role.ROLLOUT, Role.TRAIN, 1) == PROFILE["shift"]["rollout->train"]
    assert c.shift(POLICY, Role.TRAIN, Role.TRAIN, 1) == 0.0
    into = [PROFILE["shift"]["judge->train"], PROFILE["shift"]["rollout->train"]]
    assert c.shift(POLICY, None, Role.TRAIN, 1) == pytest.approx(sum(into) / 2)
    measured = costs(shift={**PROFILE["shift"], "none->train": 9.0})
    assert measured.shift(POLICY, None, Role.TRAIN, 1) == 9.0


def test_the_spread_is_optional_and_checked():
    assert costs().spreads == {} and "spread" not in costs().to_dict()
    assert [costs().spread(kind) for kind in SPREAD_KINDS] == [0.0, 0.0, 0.0]
    some = costs(spread={"shift": 0.5, "optimizer": 1.2})
    assert (some.spread("shift"), some.spread("accumulate"), some.spread("optimizer")) == (0.5, 0.0, 1.2)
    assert some.to_dict()["spread"] == {"shift": 0.5, "optimizer": 1.2}
    assert MeasuredCosts.from_dict(some.to_dict()) == some
    with pytest.raises(ValueError, match=r"spread: unknown kind 'decode'; allowed: shift, accumulate, optimizer"):
        some.spread("decode")
    with pytest.raises(ValueError, match=r"spread.decode: unknown key; allowed: shift, accumulate, optimizer"):
        costs(spread={"decode": 0.1})
    with pytest.raises(ValueError, match=r"spread.shift: got -0.5, must be a finite number >= 0"):
        costs(spread={"shift": -0.5})
    with pytest.raises(ValueError, match=r"spread: expected an object, got list"):
        costs(spread=[0.5])


def test_a_refresh_is_priced_as_measured_else_as_a_first_load():
    assert costs().refresh(POLICY, 1) == costs().shift(POLICY, None, Role.ROLLOUT, 1)
    c = costs(shift={**PROFILE["shift"], "rollout->rollout": 0.02})
    assert c.refresh(POLICY, 1) == 0.02
    assert c.shift(POLICY, Role.ROLLOUT, Role.ROLLOUT, 1) == 0.0  # a shift to the same role is no shift
    into = [PROFILE["shift"]["judge->rollout"], PROFILE["shift"]["train->rollout"]]
    assert c.shift(POLICY, None, Role.ROLLOUT, 1) == pytest.approx(sum(into) / 2)  # the refresh is not a shift into
    with pytest.raises(ValueError, match=r"shift.rollout->rollout: got -1"):
        costs(shift={**PROFILE["shift"], "rollout->rollout": -1})


# -- fitting a profile to a run -----------------------------------------------------------------

ROLLOUT_LINE = (2e-3, 3e-5, 5e-7)  # step_base_s, step_per_seq_s, step_per_kv_token_s
JUDGE_LINE = (1e-3, 1e-4, 2e-7)
PREFILL = {"rollout": 2e-5, "judge": 4e-5}
PROMPT = {"rollout": 7, "judge": 30}
TRAIN_PER_TOKEN, OPTIMIZER_S = 1e-4, 0.05
RUN_CONFIG = {
    "mode": "colocated",
    "devices": 1,
    "policy": {"path": "models/policy"},
    "judge": {"path": "models/judge", "max_new_tokens": 8},
    "rollout": {"max_batch": 8, "max_new_tokens": 16},
    "eval": {"max_new_tokens": 16},
}


class Trace:
    """A device's timeline built from known costs, written as a run directory's events.jsonl."""

    def __init__(self) -> None:
        self.t = 0.0
        self.events: list[dict] = []

    def span(self, role: str, name: str, seconds: float, **args) -> None:
        self.events.append({"device": 0, "role": role, "name": name, "start": self.t, "end": self.t + seconds,
                            "args": args})  # fmt: skip
        self.t += seconds

    def burst(self, role: str, line: tuple, batch: int, warm: int, per_slice: int, gap: float = 0.0,
              together: bool = False, log_steps: bool = False, log_kv: bool = False) -> None:  # fmt: skip
        """``batch`` sequences admitted together, decoding ``warm`` steps at full batch, then one
        finishing per step (all at once with ``together``); a slice every ``per_slice`` steps (``warm``
        a multiple of it). ``log_steps``, ``log_kv``: slices carry their decode steps and the context those
        read, as newer runs log them."""
        base, per_seq, per_kv = line
        prefill_tokens = batch * PROMPT[role]
        running, k, first = batch, 0, True
        while running:
            seconds = tokens = finished = 0.0
            load = running
            if first:
                seconds, tokens = prefill_tokens * PREFILL[role], batch
            steps = kv = 0
            for _ in range(per_slice):
                if not running:
                    break
                steps += 1
                context = PROMPT[role] + 1 + k  # the engine's context of a step: cached tokens plus the new one
                seconds += base + running * (per_seq + per_kv * context)
                kv += running * context
                tokens += running
                k += 1
                if k > warm or together and k == warm:
                    gone = running if together else 1
                    running, finished = running - gone, finished + gone
            args = {"tokens": int(tokens), "running": load, "finished": int(finished)}
            if log_steps:
                args["steps"] = steps
            if log_kv:
                args["kv"] = kv
            if first:
                args |= {"prefill_tokens": prefill_tokens, "prefill_s": prefill_tokens * PREFILL[role]}
            self.span(role, f"{role} {int(finished)} done", seconds, **args)
            self.t += gap
            first = False

    def write(self, run_dir, config=RUN_CONFIG):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config))
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in self.events))
        return run_dir


def train_and_shift(trace: Trace, version: int, samples: int = 16, tokens: int = 200) -> None:
    trace.span("shift", "judge->train", 0.2, bytes=1, version=version)
    trace.span("train", f"accumulate {samples}", (tokens + samples * PROMPT["rollout"]) * TRAIN_PER_TOKEN,
               samples=samples, tokens=tokens)  # fmt: skip
    trace.span("train", f"step v{version}->v{version + 1}", OPTIMIZER_S)
    trace.span("shift", "train->rollout", 0.1, bytes=1, version=version + 1)


def steady_run(
    gap: float = 0.0, slow_first_step: float = 3.0, line: tuple = ROLLOUT_LINE, to_judge: tuple = (0.3,) * 3, **burst
) -> Trace:
    """A first step at ``slow_first_step`` times the costs, after a 5 s first load; then three steady
    steps at the known costs, batches of 1 to 8, each ending with a rollout refresh; the steady
    steps' rollout->judge shifts take ``to_judge`` seconds."""
    tr = Trace()
    tr.span("shift", "none->rollout", 5.0, bytes=1, version=0)
    slow = tuple(c * slow_first_step for c in ROLLOUT_LINE)
    tr.burst("rollout", slow, 8, 4, 2, gap)
    tr.span("shift", "rollout->judge", 0.3, bytes=1, version=0)
    tr.burst("judge", tuple(c * slow_first_step for c in JUDGE_LINE), 8, 4, 2, gap)
    train_and_shift(tr, 0)
    for v, batches in enumerate(([8, 3], [5, 1], [2, 6, 4]), start=1):
        for b in batches:
            tr.burst("rollout", line, b, 6, 3, gap, **burst)
        tr.span("shift", "rollout->judge", to_judge[v - 1], bytes=1, version=v)
        for b in batches:
            tr.burst("judge", JUDGE_LINE, b, 4, 2, gap)
        train_and_shift(tr, v)
        tr.span("shift", "rollout->rollout", 0.05, bytes=1, version=v + 1)
    return tr


def test_fit_recovers_the_costs_a_run_was_made_with(tmp_path):
    fit = fit_run(steady_run().write(tmp_path / "run"))
    c = fit.costs
    for got, line in ((c.rollout, ROLLOUT_LINE), (c.genrm, JUDGE_LINE)):
        assert (got.step_base_s, got.step_per_seq_s, got.step_per_kv_token_s) == pytest.approx(line, rel=1e-6)
    assert c.rollout.prefill_per_token_s == pytest.approx(PREFILL["rollout"])
    assert c.genrm.prefill_per_token_s == pytest.approx(PREFILL["judge"])
    assert fit.report["rollout"]["prompt_tokens"] == pytest.approx(PROMPT["rollout"])
    assert fit.report["judge"]["prompt_tokens"] == pytest.approx(PROMPT["judge"])
    assert c.train.per_token_s == pytest.approx(TRAIN_PER_TOKEN)
    assert c.train.optimizer_step_s == pytest.approx(OPTIMIZER_S)
    assert (c.rollout.model, c.genrm.model, c.rollout.max_batch) == ("policy", "judge", 8)
    assert c.rollout.max_len == PROMPT["rollout"] + 16 and c.genrm.max_len == PROMPT["judge"] + 2 * 16 + 8
    assert fit.report["replay_out_of_step"] == 0
    assert MeasuredCosts.fit(tmp_path / "run") == c


def test_the_first_step_and_first_loads_are_left_out(tmp_path):
    fit = fit_run(steady_run(slow_first_step=10.0).write(tmp_path / "run"))
    assert fit.costs.rollout.step_base_s == pytest.approx(ROLLOUT_LINE[0], rel=1e-6)
    assert fit.report["steady_from_s"] > 5.0
    assert "none->rollout" not in fit.costs.shifts  # first loads start processes: a shift into rollout prices them


def test_shifts_are_means_with_named_fallbacks(tmp_path):
    fit = fit_run(steady_run().write(tmp_path / "run"))
    shifts = fit.costs.shifts
    assert shifts["rollout->judge"] == pytest.approx(0.3) and shifts["judge->train"] == pytest.approx(0.2)
    assert shifts["train->rollout"] == pytest.approx(0.1) and shifts["rollout->rollout"] == pytest.approx(0.05)
    assert shifts["rollout->train"] == pytest.approx(0.2)  # the median shift into train
    assert shifts["train->judge"] == pytest.approx(0.3)
    assert shifts["judge->rollout"] == pytest.approx(0.1)
    assert sorted(fit.report["fallbacks"]) == [
        "shift judge->rollout: mean shift into rollout",
        "shift rollout->train: mean shift into train",
        "shift train->judge: mean shift into judge",
    ]


def test_the_round_trip_between_slices_is_carried_by_the_line(tmp_path):
    """The simulator reports at slice ends without delay: the fitted line must add up to the slices
    plus the waits between them, or every simulated generation runs short."""
    gap = 0.004
    tr = steady_run(gap=gap)
    fit = fit_run(tr.write(tmp_path / "run"))
    c = fit.costs.rollout
    assert fit.report["rollout"]["round_trip_s"] == pytest.approx(gap)
    assert c.step_base_s > ROLLOUT_LINE[0]
    steady = [e for e in tr.events if e["role"] == "rollout" and e["start"] >= fit.report["steady_from_s"]]
    measured = sum(e["end"] - e["start"] - e["args"].get("prefill_s", 0) + gap for e in steady)
    assert fit.report["rollout"]["mean_slice_s"] * fit.report["rollout"]["slices"] == pytest.approx(measured)
    gen = [e for e in tr.events if e["role"] in ("rollout", "judge") and e["start"] >= fit.report["steady_from_s"]]
    periods = [b["start"] - a["start"] for a, b in zip(gen, gen[1:], strict=False) if b["role"] == a["role"]]
    assert min(periods) <= fit.slice_s <= max(periods)


def test_nonneg_least_squares_drops_a_term_rather_than_going_negative():
    rows = [(1.0, b, b * 0.5) for b in (1.0, 2.0, 4.0, 8.0)]
    y = [1.0 + 2.0 * b - 0.05 * b for b in (1.0, 2.0, 4.0, 8.0)]  # a negative third term would fit exactly
    coef = nonneg_least_squares(rows, y)
    assert min(coef) >= 0
    assert nonneg_least_squares([(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)], [3.0, 5.0, 7.0]) == pytest.approx([1.0, 2.0])


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "not a run directory \\(it does not exist\\)"),
        (lambda d: d.mkdir(), "not a run directory \\(no config.json\\)"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{}")), "not a run directory \\(no events.jsonl\\)"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{"), (d / "events.jsonl").write_text("")),
         "config.json: not JSON"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text(json.dumps(RUN_CONFIG)),
                    (d / "events.jsonl").write_text('{"device": 0}\n')), "events.jsonl:1: expected an object"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{}"), (d / "events.jsonl").write_text("")),
         "config.json: rollout.max_batch: got None"),
    ],
)  # fmt: skip
def test_a_bad_run_directory_is_named(tmp_path, setup, message):
    setup(tmp_path / "run")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'run'}: {message}"):
        fit_run(tmp_path / "run")


def test_a_run_without_measured_slices_is_refused(tmp_path):
    """Runs that logged no engine counters on their slices cannot be fitted; the error says what is missing."""
    tr = steady_run()
    for e in tr.events:
        if e["role"] in ("rollout", "judge"):
            e["args"] = {}
    with pytest.raises(ValueError, match="no rollout generation slices"):
        fit_run(tr.write(tmp_path / "run"))


def test_the_profile_command_prints_the_runs_job_to_simulate_on_its_costs(tmp_path, capsys):
    """What ``simulate`` needs beside the costs to run the profiled job: its devices as instances, its prompts
    as its engines prefilled them, the judge prompt beside prompt and response, its judgments' length (from
    metrics.jsonl: 2 steps of 16 samples, responses of 10 tokens and judgments of 40) and each sample's
    response length, written as a trace that ``sim.lengths_replay`` reads."""
    run = steady_run().write(tmp_path / "run", {**RUN_CONFIG, "devices": 3})
    fit = fit_run(run)
    step = {"response_tokens": 160, "response_length": 10.0, "judge_tokens": 640}
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, **step}) + "\n" for i in (1, 2)))
    (run / "samples.jsonl").write_text(
        "".join(json.dumps({"step": 1, "uid": u, "response_ids": [5] * (u + 1)}) + "\n" for u in range(4))
    )
    assert main(["profile", str(run), "--out", str(tmp_path / "costs.json")]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    prompt, judge = (fit.report[r]["prompt_tokens"] for r in ("rollout", "judge"))
    trace = tmp_path / "costs.lengths.jsonl"
    assert line.endswith(
        f"pivotrl simulate {run / 'config.json'} sim.costs={tmp_path / 'costs.json'} sim.gpus=3 "
        f"sim.prompt_len={round(prompt)} sim.judge_template_len={max(0, round(judge - prompt - 10))} "
        f"sim.judge_output_len=40 sim.slice_s={fit.slice_s:.4f} sim.lengths_file={trace} sim.lengths_replay=true "
        "--out DIR"
    ), line
    assert judge > prompt and replay_table(trace) == {(1, u): u + 1 for u in range(4)}


def test_the_profile_command_writes_a_loadable_file(tmp_path, capsys):
    run = steady_run().write(tmp_path / "run")
    assert main(["profile", str(run), "--out", str(tmp_path / "costs.json")]) == 0
    assert MeasuredCosts.load(tmp_path / "costs.json") == fit_run(run).costs
    assert "costs.json" in capsys.readouterr().out
    assert main(["profile", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "not a run directory" in err and "Traceback" not in err and not (tmp_path / "x.json").exists()


def test_logged_decode_steps_are_used(tmp_path):
    """Whole batches finishing at once break the even-finishing estimate of a slice's steps; runs that
    log them are fitted exactly."""
    line = (2e-3, 3e-5, 0.0)
    logged = fit_run(steady_run(line=line, together=True, log_steps=True).write(tmp_path / "logged")).costs.rollout
    assert (logged.step_base_s, logged.step_per_seq_s) == pytest.approx(line[:2], rel=1e-6)
    guessed = fit_run(steady_run(line=line, together=True).write(tmp_path / "guessed")).costs.rollout
    assert guessed.step_base_s != pytest.approx(line[0], rel=1e-3)


def test_logged_context_reads_are_used(tmp_path):
    """The context a slice's steps read, estimated from the batch and its finishes, is off where whole
    batches finish at once; runs that log it (the engine counts it) are fitted exactly."""
    logged = fit_run(steady_run(together=True, log_steps=True, log_kv=True).write(tmp_path / "logged")).costs.rollout
    assert (logged.step_base_s, logged.step_per_seq_s, logged.step_per_kv_token_s) == pytest.approx(
        ROLLOUT_LINE, rel=1e-6
    )
    guessed = fit_run(steady_run(together=True, log_steps=True).write(tmp_path / "guessed")).costs.rollout
    assert guessed.step_per_kv_token_s != pytest.approx(ROLLOUT_LINE[2], rel=1e-3)


def test_the_call_term_of_training_is_fitted_when_call_sizes_differ(tmp_path):
    tr = steady_run()
    acc = [e for e in tr.events if e["name"].startswith("accumulate")][1:]  # the steady ones
    for e, samples in zip(acc, (8, 16, 64), strict=True):  # calls of 8 to 64 samples, 12 response tokens each
        tokens = samples * (12 + PROMPT["rollout"])
        e["args"] = {"samples": samples, "tokens": samples * 12}
        e["end"] = e["start"] + 0.02 + tokens * TRAIN_PER_TOKEN  # a 20 ms call; later spans keep their start
    train = fit_run(tr.write(tmp_path / "run")).costs.train
    assert (train.per_call_s, train.per_token_s) == pytest.approx((0.02, TRAIN_PER_TOKEN), rel=1e-6)
    c = MeasuredCosts(costs().rollout, costs().genrm, train, costs().shifts)
    assert c.train_tokens(POLICY, 1000, 1) == pytest.approx(0.02 + 1000 * TRAIN_PER_TOKEN)
    assert c.train_tokens(POLICY, 0, 1) == 0.0


def test_the_call_term_is_optional_and_checked():
    assert costs().train.per_call_s == 0.0 and "per_call_s" not in costs().to_dict()["train"]
    with_call = costs(train={**PROFILE["train"], "per_call_s": 0.01})
    assert with_call.to_dict()["train"]["per_call_s"] == 0.01
    assert MeasuredCosts.from_dict(with_call.to_dict()) == with_call
    with pytest.raises(ValueError, match=r"train.per_call_s: got -0.1, must be a finite number >= 0"):
        costs(train={**PROFILE["train"], "per_call_s": -0.1})


def test_a_fitted_profile_drives_a_simulation_of_its_job(tmp_path):
    """A fitted profile is a ``sim.costs`` file for the job it was fitted to (its engines' limits included)."""
    fit = fit_run(steady_run().write(tmp_path / "run"))
    fit.costs.save(tmp_path / "costs.json")
    job = ["mode=colocated", "steps=2", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_batch=8",
           "rollout.max_new_tokens=16", "eval.max_new_tokens=16", "eval.size=4", "judge.max_new_tokens=8",
           f"sim.prompt_len={PROMPT['rollout']}", "sim.judge_template_len=4", "sim.judge_output_len=6", "sim.gpus=1",
           "sim.lengths.kind=fixed", "sim.lengths.value=10", f"sim.slice_s={fit.slice_s}",
           f"sim.costs={tmp_path / 'costs.json'}"]  # fmt: skip
    summary = run_simulation(load_config(Path(__file__).parents[2] / "examples/default.yaml", job), tmp_path / "sim")
    assert summary["steps"] == 2 and summary["sim_seconds"] > 0


def test_a_job_longer_than_the_measured_engines_names_the_sim_length_keys(tmp_path):
    """The documented replay with the default sim.prompt_len (512) and sim.judge_template_len (256) was refused
    as "Qwen2.5-7B with 608-token sequences does not fit on 1 x H100", a model and GPU not involved."""
    costs = fit_run(steady_run().write(tmp_path / "run")).costs
    costs.save(tmp_path / "costs.json")
    rollout, genrm = costs.rollout, costs.genrm
    job = ["rollout.max_new_tokens=16", "eval.max_new_tokens=16", "judge.max_new_tokens=8", "sim.gpus=1",
           f"sim.costs={tmp_path / 'costs.json'}"]  # fmt: skip
    config = Path(__file__).parents[2] / "examples/default.yaml"

    def error(*more: str) -> str:
        with pytest.raises(UserError) as info:
            run_simulation(load_config(config, [*job, *more]), tmp_path / "sim")
        return str(info.value)

    assert error() == (
        f"sim.costs: the measured rollout engine ('policy') holds sequences of up to {rollout.max_len} tokens, its "
        f"run's prompts and limits; this job's are 528: sim.prompt_len is 512, at most {rollout.max_len - 16} fits "
        "beside 16 new tokens (rollout/eval.max_new_tokens)"
    )
    assert error(f"sim.prompt_len={PROMPT['rollout']}").startswith(
        f"sim.costs: the measured judge engine ('judge') holds sequences of up to {genrm.max_len} tokens"
    )
    assert "sim.prompt_len + sim.judge_template_len is 2" in error(f"sim.prompt_len={PROMPT['rollout']}")
    assert error("rollout.max_new_tokens=400").endswith(
        "400 new tokens (rollout/eval.max_new_tokens) leave no room for sim.prompt_len"
    )
    assert not (tmp_path / "sim").exists()


def test_an_exact_run_has_no_spread_and_a_varied_one_is_measured(tmp_path):
    exact = fit_run(steady_run().write(tmp_path / "exact")).costs
    assert exact.spreads == pytest.approx({"shift": 0.0, "accumulate": 0.0, "optimizer": 0.0}, abs=1e-9)
    varied = fit_run(steady_run(to_judge=(0.2, 0.3, 0.4)).write(tmp_path / "varied")).costs
    assert varied.shifts["rollout->judge"] == pytest.approx(0.3)
    # three of the 13 steady shifts (four a step, and the first step's last) are 2/3, 1 and 4/3 of
    # their pair's mean, the rest exactly it
    ratios = [2 / 3, 1, 4 / 3] + [1.0] * 10
    assert varied.spread("shift") == pytest.approx(statistics.pstdev(ratios))
    assert (varied.spread("accumulate"), varied.spread("optimizer")) == pytest.approx((0.0, 0.0), abs=1e-9)


def test_the_training_line_adds_up_to_the_measured_calls(tmp_path):
    """Calls of different sizes running slower or faster than any line: least squares alone would weigh
    the small ones like the big one; the fitted line adds up to the time they took, and their scatter
    about it is the accumulate spread."""
    tr = steady_run()
    acc = [e for e in tr.events if e["name"].startswith("accumulate")][1:]
    for e, samples, slow in zip(acc, (8, 16, 64), (1.0, 0.8, 1.5), strict=True):
        tokens = samples * (12 + PROMPT["rollout"])
        e["args"] = {"samples": samples, "tokens": samples * 12}
        e["end"] = e["start"] + slow * (0.02 + tokens * TRAIN_PER_TOKEN)
    train = fit_run(tr.write(tmp_path / "run")).costs
    line = [train.train.per_call_s + train.train.per_token_s * e["args"]["samples"] * (12 + PROMPT["rollout"])
            for e in acc]  # fmt: skip
    assert sum(line) == pytest.approx(sum(e["end"] - e["start"] for e in acc))
    assert train.spread("accumulate") > 0.1


def test_a_simulated_run_is_refused(tmp_path, capsys):
    """A run of ``pivotrl simulate`` has the simulator's costs, and slices without the engine's counters: it was
    refused with "a rollout slice ... has no running/finished"; it is named for what it is, even cut short."""
    job = ["steps=1", "eval.size=4", "rollout.prompts_per_step=4", "rollout.group_size=2", "sim.gpus=2"]
    run_simulation(load_config(Path(__file__).parents[2] / "examples/default.yaml", job), tmp_path / "sim")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'sim'}: a simulated run .*profile measures a run of `pivotr"):
        fit_run(tmp_path / "sim")
    assert main(["profile", str(tmp_path / "sim"), "--out", str(tmp_path / "costs.json")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # (the lines before: the simulation's log)
    assert last.startswith(f"pivotrl: error: {tmp_path / 'sim'}: a simulated run (`pivotrl simulate` wrote it)")
    (tmp_path / "sim" / "summary.json").unlink()  # (cut short: its samples have token counts, not tokens)
    with pytest.raises(ValueError, match="a simulated run"):
        fit_run(tmp_path / "sim")


def test_a_costs_file_written_with_the_judges_old_name_loads_the_same():
    """The judge's role was once named genrm: a costs file written then (its key, its shift pairs) still loads."""
    old = copy.deepcopy(PROFILE)
    old["genrm"] = old.pop("judge")
    old["shift"] = {k.replace("judge", "genrm"): v for k, v in old["shift"].items()}
    assert any("genrm" in k for k in old["shift"])
    assert MeasuredCosts.from_dict(old) == MeasuredCosts.from_dict(copy.deepcopy(PROFILE))
