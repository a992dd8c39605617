"""An instance running a role on several engines, and the elastic bound over its layouts."""

from __future__ import annotations

import json
import math

import pytest

from pivotrl.config import load_config
from pivotrl.control.messages import Generate, GenParams, GenRequest, Role, Shift
from pivotrl.errors import UserError
from pivotrl.sim.costs import CostModel, RooflineCosts, span_of
from pivotrl.sim.driver import SimDriver
from pivotrl.sim.hardware import GPUS
from pivotrl.sim.ideal import ideal_for_job
from pivotrl.sim.layout import EngineLayout, role_costs
from pivotrl.sim.models import MODELS
from pivotrl.sim.run import build, format_sizes
from tests.sim.test_driver import drain, shifted
from tests.sim.test_run import EXAMPLE

H100 = RooflineCosts(GPUS["H100"])
QWEN7, QWEN32 = MODELS["Qwen2.5-7B"], MODELS["Qwen2.5-32B"]
BATCHES = (1, 2, 3, 7, 8, 64, 255, 256, 1024)


def test_one_engine_of_the_whole_instance_is_the_base_cost_model_itself():
    """Jobs that name no engines are priced exactly as before: no wrapper in the engines' inner loop."""
    assert role_costs(H100, 4, 0, False) is H100
    assert role_costs(H100, 4, 4, False) is H100
    assert isinstance(role_costs(H100, 4, 2, False), EngineLayout)
    assert isinstance(role_costs(H100, 4, 4, True), EngineLayout)
    assert isinstance(EngineLayout(H100, 4, 2), CostModel)


def test_a_step_of_several_engines_is_each_engines_share_in_parallel():
    two = EngineLayout(H100, 4, 2)
    for batch in BATCHES:
        share = math.ceil(batch / 2)
        assert two.decode_span(QWEN7, 4, batch, 900.0, 37) == H100.decode_span(QWEN7, 2, share, 900.0, 37)
        assert two.decode_step(QWEN7, 4, batch, 900.0) == pytest.approx(H100.decode_step(QWEN7, 2, share, 900.0))
    assert two.decode_span(QWEN7, 4, 0, 900.0, 37) == 0.0
    # one prompt runs on one engine; a batch of them is spread
    assert two.prefill(QWEN7, 4, 5000) == H100.prefill(QWEN7, 2, 5000)
    assert two.prefill(QWEN7, 4, 64 * 512, 512) == H100.prefill(QWEN7, 2, 32 * 512, 512)
    assert two.prefill(QWEN7, 4, 3 * 512, 512) == H100.prefill(QWEN7, 2, 2 * 512, 512)
    assert two.migration(QWEN7, 4, 3000) == H100.migration(QWEN7, 2, 3000)


def test_several_engines_hold_each_its_own_weights_and_cache():
    """Two engines of 2 GPUs hold the weights twice: less KV cache than one engine of 4, each GPU loads
    half the model (not a quarter) when the role is taken; a trainer still spreads over the instance."""
    two, one = EngineLayout(H100, 4, 2), EngineLayout(H100, 4, 4)
    assert two.engines == 2 and one.engines == 1
    assert two.kv_tokens(QWEN7, 4) == 2 * H100.kv_tokens(QWEN7, 2) < H100.kv_tokens(QWEN7, 4)
    assert two.max_batch(QWEN7, 4, 9000) == 2 * H100.max_batch(QWEN7, 2, 9000)
    assert two.shift(QWEN7, None, Role.ROLLOUT, 4) == H100.shift(QWEN7, None, Role.ROLLOUT, 2)
    assert two.shift(QWEN7, Role.ROLLOUT, Role.TRAIN, 4) == H100.shift(QWEN7, Role.ROLLOUT, Role.TRAIN, 4)
    assert two.refresh(QWEN7, 4) == H100.refresh(QWEN7, 2) > H100.refresh(QWEN7, 4)
    with pytest.raises(ValueError, match="engine_tp: got 3, must divide the instance's 4 GPUs"):
        EngineLayout(H100, 4, 3)


def test_elastic_engines_take_the_fastest_layout_of_each_span():
    """Small engines win on big batches (no collectives), large ones on the tail (each token sooner);
    the elastic bound takes whichever is faster, span by span."""
    elastic = EngineLayout(H100, 8, 1, elastic=True)
    assert [g for g, _, _ in elastic.layouts(QWEN7)] == [1, 2, 4, 8]
    fixed = [EngineLayout(H100, 8, g) for g in (1, 2, 4, 8)]
    for batch in BATCHES:
        spans = [f.decode_span(QWEN7, 8, batch, 1500.0, 100) for f in fixed]
        assert elastic.decode_span(QWEN7, 8, batch, 1500.0, 100) == min(spans)
    assert min(fixed, key=lambda f: f.decode_step(QWEN7, 8, 2048, 1500.0)).engine_tp < 8
    assert min(fixed, key=lambda f: f.decode_step(QWEN7, 8, 1, 1500.0)).engine_tp > 1
    # a 32B judge does not fit beside its cache on one H100 of 80 GB with long sequences: its layouts start at 2
    assert [g for g, _, _ in EngineLayout(H100, 8, 2, elastic=True).layouts(QWEN32)] == [2, 4, 8]
    assert [g for g, _, _ in EngineLayout(H100, 8, 2).layouts(QWEN32)] == [2]


def test_the_span_function_is_kept_per_model():
    layout = EngineLayout(H100, 4, 2, elastic=True)
    assert layout.span_of(QWEN7, 4) is layout.span_of(QWEN7, 4)
    assert span_of(layout, QWEN7, 4) is layout.span_of(QWEN7, 4)
    assert layout.span_of(QWEN32, 4) is not layout.span_of(QWEN7, 4)


CUT_IN_8 = ("sim.policy_model=Qwen2.5-14B", "sim.judge_model=Qwen2.5-14B")  # (a 7B's 28 heads do not cut in 8)


def small(*extra: str) -> list[str]:
    return ["sim.gpus=8", "sim.instance_gpus=4", "rollout.max_new_tokens=4096", "rollout.max_batch=32", *extra]


def test_an_instance_holds_the_slots_of_all_its_engines():
    spec = build(load_config(None, small("sim.rollout_engine_gpus=1", "sim.judge_engine_gpus=2"))).spec
    assert spec.engines(Role.ROLLOUT) == 4 and spec.engines(Role.JUDGE) == 2 and spec.engines(Role.TRAIN) == 1
    assert spec.capacity(Role.ROLLOUT) == 4 * 32 and spec.capacity(Role.JUDGE) == 2 * 32
    assert spec.role_costs(Role.TRAIN) is spec.costs
    plain = build(load_config(None, small())).spec
    assert plain.role_costs(Role.ROLLOUT) is plain.costs and plain.capacity(Role.ROLLOUT) == 32


def test_a_simulated_instance_loads_and_decodes_as_its_engines_do():
    """Six sequences of one length on two engines of 2 GPUs end when three end on one instance of 2 (each
    engine loads the model and prefills and decodes its three); on one engine of 4 they end sooner, its
    steps reading a quarter of the weights per GPU."""
    requests = tuple(GenRequest(u, f"q{u}", seed=u, params=GenParams(64)) for u in range(6))  # all cut at 64

    def run(*overrides: str, n: int = 6) -> SimDriver:
        d = SimDriver(build(load_config(None, small("sim.slice_s=2", *overrides))).spec)
        shifted(d, Role.ROLLOUT, 0)
        d.submit(Generate(0, requests[:n], 0))
        assert len(drain(d)) == n
        return d

    two = run("sim.rollout_engine_gpus=2")
    shift = next(s for s in two.slices() if s.role == "shift")
    assert shift.end - shift.start == pytest.approx(H100.shift(QWEN7, None, Role.ROLLOUT, 2))
    assert two.clock() == pytest.approx(run("sim.instance_gpus=2", n=3).clock())
    assert run().clock() < two.clock()
    two.submit(Shift(0, Role.TRAIN, 0))  # leaving for training still works on the instance
    two.next_events()


def test_the_ideal_prices_each_role_on_its_engines():
    """Rollout engines of 2 GPUs in instances of 4 do the rollout's work at the price of instances of 2
    (the same batch on each engine); the judge, on one engine of 4, at the price of instances of 4."""
    mixed = ideal_for_job(load_config(None, small("sim.rollout_engine_gpus=2", "sim.gpus=16")))
    twos = ideal_for_job(load_config(None, small("sim.instance_gpus=2", "sim.gpus=16")))
    fours = ideal_for_job(load_config(None, small("sim.gpus=16")))
    for key in ("rollout_prefill", "rollout_decode"):
        assert mixed.gpu_seconds[key] == pytest.approx(twos.gpu_seconds[key])
    for key in ("judge_prefill", "judge_decode"):
        assert mixed.gpu_seconds[key] == pytest.approx(fours.gpu_seconds[key])


def test_the_elastic_bound_is_below_every_fixed_layout():
    """Every span of the elastic instance is the shortest of its layouts', so its floor is below each
    fixed layout's at the same size, and so is its work."""
    job = ["sim.gpus=64", "sim.instance_gpus=8", "rollout.max_new_tokens=8192", "rollout.prompts_per_step=64",
           *CUT_IN_8]  # fmt: skip
    elastic = ideal_for_job(load_config(None, [*job, "sim.elastic_engines=true"]))
    assert elastic.floor_seconds <= ideal_for_job(load_config(None, job)).floor_seconds
    smallest = ideal_for_job(load_config(None, [*job, "sim.rollout_engine_gpus=1", "sim.judge_engine_gpus=1"]))
    assert elastic.floor_seconds <= smallest.floor_seconds
    # a full instance's batch runs on whichever engines price it lowest: the smallest, or larger ones
    # whose bigger share of it reaches more of the tensor cores
    assert elastic.gpu_seconds["rollout_decode"] <= smallest.gpu_seconds["rollout_decode"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["sim.rollout_engine_gpus=3"], "sim.rollout_engine_gpus: expected 0 (one engine of the instance) or a"),
        (["sim.judge_engine_gpus=8"], "sim.judge_engine_gpus: expected 0 (one engine of the instance) or a"),
        (["sim.elastic_engines=true", "sim.instance_gpus=1", "sim.gpus=8"], "sim.elastic_engines: an instance of 1"),
        (["sim.judge_model=Qwen3-235B-A22B", "sim.policy_model=Qwen2.5-14B", "sim.instance_gpus=8",
          "sim.judge_engine_gpus=4"],
         "sim.judge_engine_gpus: Qwen3-235B-A22B with .* does not fit on an engine of 4 x H100"),
        (["sim.judge_model=Qwen3-235B-A22B"], "tensor_parallel: Qwen3-235B-A22B with .* does not fit on 4 x H100"),
    ],
)  # fmt: skip
def test_a_bad_engine_setting_names_the_key(args, message):
    with pytest.raises((UserError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
        build(load_config(None, small(*args)))


def test_the_hint_compares_with_one_engine_a_role():
    """Engines of 1 GPU in instances of 4 have the floor of instances of 1: the hint names one engine of 4,
    and the keys to set back. Engines of all 4 GPUs are one engine a role: nothing to name."""
    # (a job whose best instances hold 4 GPUs: without activation checkpointing's extra forward in training)
    job = ["sim.gpus=128", "sim.instance_gpus=4", "rollout.max_new_tokens=8192", "rollout.prompts_per_step=512",
           "rollout.group_size=16", "train.activation_checkpointing=false"]  # fmt: skip
    hint = format_sizes(load_config(None, [*job, "sim.rollout_engine_gpus=1", "sim.judge_engine_gpus=1"]))
    assert hint is not None and "instances of 4 GPUs, one engine a role" in hint
    assert hint.endswith("try tensor_parallel=4 sim.rollout_engine_gpus=0 sim.judge_engine_gpus=0")
    assert format_sizes(load_config(None, [*job, "sim.rollout_engine_gpus=4"])) is None


def test_an_elastic_layout_must_hold_its_share_of_the_batch():
    """Engines of ``slots`` sequences: a batch too large for the small engines runs on larger ones, and on
    the largest where no layout holds it."""
    elastic = EngineLayout(H100, 8, 1, elastic=True, slots=16)
    fixed = {g: EngineLayout(H100, 8, g) for g in (1, 2, 4, 8)}
    assert elastic.decode_span(QWEN7, 8, 64, 900.0, 10) == min(fixed[g].decode_span(QWEN7, 8, 64, 900.0, 10)
                                                               for g in (1, 2))  # fmt: skip
    assert elastic.decode_span(QWEN7, 8, 1000, 900.0, 10) == fixed[8].decode_span(QWEN7, 8, 1000, 900.0, 10)
    assert elastic.max_batch(QWEN7, 8, 9000) == max(k * H100.max_batch(QWEN7, 8 // k, 9000) for k in (1, 2, 4, 8))
    assert elastic.kv_tokens(QWEN7, 8) == max(k * H100.kv_tokens(QWEN7, 8 // k) for k in (1, 2, 4, 8))


def test_elastic_engines_hold_what_their_roomiest_layout_holds():
    """A 32B judge on one GPU has room for a few sequences beside its weights, on eight GPUs for hundreds:
    the elastic instance admits what the roomiest layout holds, not what its smallest engines do."""
    job = ["sim.gpus=64", "sim.instance_gpus=8", "sim.judge_model=Qwen2.5-32B", "rollout.max_new_tokens=8192",
           "rollout.max_batch=256", "sim.policy_model=Qwen2.5-14B"]  # fmt: skip
    elastic = build(load_config(None, [*job, "sim.elastic_engines=true"])).spec
    fixed = [build(load_config(None, [*job, f"sim.judge_engine_gpus={g}"])).spec for g in (1, 2, 4, 8)]
    assert elastic.engine_tp[1] == 1
    assert elastic.capacity(Role.JUDGE) == max(f.capacity(Role.JUDGE) for f in fixed) > fixed[0].capacity(Role.JUDGE)


def test_a_runs_summary_says_how_its_instances_run_their_roles(tmp_path, capsys):
    from pivotrl.cli import main

    job = ["sim.gpus=8", "sim.instance_gpus=4", "steps=1", "rollout.prompts_per_step=8", "rollout.group_size=2",
           "rollout.max_new_tokens=256", "eval.size=8", "eval.max_new_tokens=256", "sim.lengths.median=64"]  # fmt: skip
    assert main(["simulate", EXAMPLE, *job, "sim.rollout_engine_gpus=2", "--out", str(tmp_path / "a"),
                 "--quiet"]) == 0  # fmt: skip
    assert "(2 instances of 4 GPU, rollout on 2 engines of 2)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "a/summary.json").read_text())["sim"]
    assert summary["engine_gpus"] == {"rollout": 2, "judge": 4} and summary["elastic_engines"] is False
    assert main(["simulate", EXAMPLE, *job, "sim.elastic_engines=true", "--out", str(tmp_path / "b"),
                 "--quiet"]) == 0  # fmt: skip
    assert "engines elastic from 1 (rollout), 1 (judge) GPUs to 4: a bound" in capsys.readouterr().out
    assert main(["simulate", EXAMPLE, *job, "--out", str(tmp_path / "c"), "--quiet"]) == 0
    assert "(2 instances of 4 GPU)," in capsys.readouterr().out
