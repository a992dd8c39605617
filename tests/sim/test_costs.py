import dataclasses

import pytest

from pivotrl.control.messages import Role
from pivotrl.sim.costs import (
    CostModel,
    DeployedCosts,
    RooflineCosts,
    ScaledCosts,
    max_batch,
    span_of,
    steps_within,
)
from pivotrl.sim.hardware import GPUS
from pivotrl.sim.models import MODELS

H100 = RooflineCosts(GPUS["H100"])
QWEN7, QWEN32 = MODELS["Qwen2.5-7B"], MODELS["Qwen2.5-32B"]
A3B, A22B = MODELS["Qwen3-30B-A3B"], MODELS["Qwen3-235B-A22B"]


def test_roofline_is_a_cost_model():
    assert isinstance(H100, CostModel)


# -- decode -----------------------------------------------------------------------------


def test_decode_is_memory_bound_alone_and_compute_bound_in_a_large_batch():
    assert H100.decode_terms(QWEN7, 1, 1, 512).bound == "memory"
    assert H100.decode_terms(QWEN7, 1, 1024, 128).bound == "compute"


def test_decode_times_are_in_the_range_engines_reach():
    # batch 1: ~15 GB of weights at 3.35 TB/s is 4.5 ms, plus per-step overhead
    assert 7e-3 < H100.decode_step(QWEN7, 1, 1, 512) < 12e-3
    # batch 256 at 2k context: 30 GB of KV cache on top of the weights
    assert 20e-3 < H100.decode_step(QWEN7, 1, 256, 2048) < 60e-3


def test_decode_grows_sublinearly_with_batch_until_the_knee():
    times = {b: H100.decode_step(QWEN7, 1, b, 1024) for b in (1, 2, 4, 8, 16, 32, 64, 128)}
    for b in (1, 2, 4, 8, 16, 32, 64):
        assert times[b] < times[2 * b] < 2 * times[b]
    assert times[128] / times[1] < 4  # 128x the tokens for < 4x the time


def test_decode_of_an_empty_batch_costs_nothing():
    assert H100.decode_step(QWEN7, 1, 0, 1000) == 0.0


def test_moe_reads_fewer_bytes_at_batch_one_than_dense_of_its_size():
    dense_twin = dataclasses.replace(A3B, active_params=A3B.total_params, experts=0, active_experts=0)
    moe, dense = H100.decode_terms(A3B, 1, 1, 512), H100.decode_terms(dense_twin, 1, 1, 512)
    assert moe.memory_s < dense.memory_s / 5
    # a large batch touches every expert: the weight reads converge
    assert H100.decode_terms(A3B, 1, 512, 0).memory_s == pytest.approx(
        H100.decode_terms(dense_twin, 1, 512, 0).memory_s, rel=0.01
    )


def test_tensor_parallelism_speeds_up_a_large_model_at_small_batch():
    for batch in (1, 16):
        assert H100.decode_step(QWEN32, 8, batch, 1024) < H100.decode_step(QWEN32, 1, batch, 1024) / 2


def test_tensor_parallelism_across_nodes_pays_the_network():
    assert H100.decode_terms(A22B, 16, 64, 1024).comm_s > 2 * H100.decode_terms(A22B, 8, 64, 1024).comm_s


@pytest.mark.parametrize(
    ("model", "tp", "batch", "context"), [(QWEN7, 1, 64, 100), (A3B, 2, 8, 3000), (QWEN7, 1, 900, 500)]
)
def test_decode_span_sums_the_steps(model, tp, batch, context):
    steps = 700  # long enough for the last case to cross from compute- to memory-bound
    loop = sum(H100.decode_step(model, tp, batch, context + i) for i in range(steps))
    assert H100.decode_span(model, tp, batch, context, steps) == pytest.approx(loop, rel=1e-9)
    assert H100.decode_span(model, tp, batch, context, 0) == 0.0


def test_an_engines_span_is_decode_span_to_the_last_bit():
    """``span_of`` (what engines call, the roofline's sum inlined) gives exactly ``decode_span``'s floats,
    on either side of the crossing of the roofline's two lines and across it."""
    for model, tp in ((QWEN7, 1), (A3B, 2), (QWEN32, 4)):
        span = span_of(H100, model, tp)
        for batch in (0, 1, 8, 64, 255, 900, 4000):
            for context in (0, 1, 100.5, 3000, 60_000):
                for steps in (0, 1, 2, 7, 700, 20_000):
                    assert span(batch, context, steps) == H100.decode_span(model, tp, batch, context, steps)


def test_steps_within_inverts_the_span():
    seconds = 1.234
    k = steps_within(H100, QWEN7, 1, 128, 500, seconds, limit=10_000)
    assert H100.decode_span(QWEN7, 1, 128, 500, k) <= seconds < H100.decode_span(QWEN7, 1, 128, 500, k + 1)
    assert steps_within(H100, QWEN7, 1, 128, 500, 1e6, limit=77) == 77
    assert steps_within(H100, QWEN7, 1, 128, 500, 0.0, limit=77) == 0


# -- memory -----------------------------------------------------------------------------


def test_max_batch_is_set_by_kv_memory():
    gpu = GPUS["H100"]
    free = gpu.hbm_bytes * 0.9 - QWEN7.weight_bytes
    assert max_batch(QWEN7, 1, gpu, 2048) == int(free // (2048 * 57344))
    assert H100.max_batch(QWEN7, 1, 2048) == max_batch(QWEN7, 1, gpu, 2048)


def test_max_batch_shrinks_with_context_and_model_size():
    assert H100.max_batch(QWEN7, 1, 1024) > H100.max_batch(QWEN7, 1, 4096) > H100.max_batch(QWEN7, 1, 16384) > 0
    assert H100.max_batch(QWEN7, 1, 2048) > H100.max_batch(QWEN32, 1, 2048) > 0


def test_max_batch_is_zero_when_the_weights_do_not_fit():
    assert H100.max_batch(A22B, 1, 1024) == 0
    assert H100.max_batch(A22B, 8, 1024) > 0
    assert RooflineCosts(GPUS["H200"]).max_batch(A22B, 8, 1024) > H100.max_batch(A22B, 8, 1024)


def test_kv_heads_are_replicated_past_their_count():
    # 4 KV heads over 8 GPUs: each head is held twice, so 8 GPUs hold half the tokens 4 would hold per byte
    gpu = GPUS["H100"]
    free8 = 8 * gpu.hbm_bytes * 0.9 - QWEN7.weight_bytes
    assert max_batch(QWEN7, 8, gpu, 1000) == int(free8 // (1000 * 57344 * 2))


@pytest.mark.parametrize(("kwargs", "message"), [({"tp": 0}, "tp: got 0"), ({"context_len": 0}, "context_len")])
def test_max_batch_checks_its_arguments(kwargs, message):
    args = {"model": QWEN7, "tp": 1, "gpu": GPUS["H100"], "context_len": 100, **kwargs}
    with pytest.raises(ValueError, match=message):
        max_batch(**args)


# -- prefill, training, shifts ------------------------------------------------------------


def test_prefill_is_compute_bound_and_attention_grows_with_length():
    terms = H100.prefill_terms(QWEN7, 1, 8192)
    assert terms.bound == "compute"
    assert H100.prefill(QWEN7, 1, 8192) > H100.prefill(QWEN7, 1, 8192, seq_len=1024)
    assert H100.migration(QWEN7, 1, 1500) == H100.prefill(QWEN7, 1, 1500)


def test_train_time_halves_with_twice_the_gpus():
    one = H100.train_tokens(QWEN7, 1_000_000, 32, seq_len=2048)
    assert H100.train_tokens(QWEN7, 1_000_000, 64, seq_len=2048) == pytest.approx(one / 2)
    assert H100.train_tokens(QWEN7, 1_000_000, 64, seq_len=2048) > H100.train_tokens(QWEN7, 1_000_000, 64)


def test_train_time_is_six_flops_per_weight_at_the_mfu():
    seconds = H100.train_tokens(QWEN7, 1_000_000, 64)
    assert seconds == pytest.approx(3 * QWEN7.flops_per_token * 1e6 / (64 * 989e12 * H100.mfu_dense))
    moe = H100.train_tokens(A3B, 1_000_000, 64)
    assert moe == pytest.approx(3 * A3B.flops_per_token * 1e6 / (64 * 989e12 * H100.mfu_moe))


def test_optimizer_step_syncs_over_the_group():
    alone = H100.optimizer_step(QWEN7, 1)
    update = QWEN7.total_params * 30 / (GPUS["H100"].hbm_bw * H100.bw_eff)
    shard = 2 * QWEN7.total_params * 12 / (64e9 * 0.8)  # the whole optimizer state from the host and back
    assert alone == pytest.approx(update + shard)
    assert H100.optimizer_step(QWEN7, 16) > H100.optimizer_step(QWEN7, 8)  # past the node: the network
    assert H100.optimizer_step(QWEN7, 128) < 1.0 < alone  # a sliver of the state each, over the network


def test_shifting_into_training_loads_the_weights_and_builds_the_trainer():
    into_train = H100.shift(QWEN7, Role.ROLLOUT, Role.TRAIN, 8)
    into_rollout = H100.shift(QWEN7, Role.TRAIN, Role.ROLLOUT, 8)
    assert into_rollout > into_train > H100.train_build_s  # no engine to start; the group meets at the step
    # the optimizer shard comes at the optimizer step: the same bytes, a different start
    assert into_train - H100.train_build_s == pytest.approx(into_rollout - H100.engine_start_s)
    assert H100.regroup(QWEN7, 8) == H100.group_start_s and H100.regroup(QWEN7, 1) == 0.0  # one meets nobody
    assert H100.shift(QWEN7, Role.JUDGE, Role.ROLLOUT, 1) > H100.shift(QWEN7, Role.JUDGE, Role.ROLLOUT, 8)
    assert H100.shift(QWEN7, Role.ROLLOUT, Role.ROLLOUT, 1) == 0.0
    assert H100.shift(QWEN7, None, Role.ROLLOUT, 1) == H100.shift(QWEN7, Role.JUDGE, Role.ROLLOUT, 1)
    # bf16 weights over PCIe Gen5 at 80%: ~0.3 s for a 7B model, plus the engine start
    assert into_rollout - H100.engine_start_s == pytest.approx(QWEN7.weight_bytes / 8 / (64e9 * 0.8))


@pytest.mark.parametrize(("field", "value"), [("bw_eff", 1.5), ("mfu_dense", 0.0), ("step_overhead_s", -1.0)])
def test_bad_efficiencies_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        RooflineCosts(GPUS["H100"], **{field: value})


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: H100.decode_step(QWEN7, 0, 1, 1), "tp: got 0"),
        (lambda: H100.decode_step(QWEN7, 1, -1, 1), "batch: got -1"),
        (lambda: H100.decode_span(QWEN7, 1, 1, 1, -2), "steps: got -2"),
        (lambda: H100.train_tokens(QWEN7, 100, 0), "n_gpus: got 0"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -- the deployed colocated baseline ---------------------------------------------------------

DENSE7, DENSE14, MOE30 = MODELS["Qwen2.5-7B"], MODELS["Qwen2.5-14B"], MODELS["Qwen3-30B-A3B"]


def deployed(policy=DENSE7, genrm=DENSE7, gpus=128) -> DeployedCosts:
    return DeployedCosts(GPUS["H100"], policy_model=policy, judge_model=genrm, gpus=gpus)


def test_deployed_switches_cost_their_published_parts():
    c = deployed()
    wake = c.engine_switch_s + DENSE7.weight_bytes / 4 / c.wake_bw
    sleep = c.engine_switch_s + DENSE7.weight_bytes / 4 / c.sleep_bw
    offload, onload = c.trainer_swap(DENSE7, offload=True), c.trainer_swap(DENSE7, offload=False)
    # into the rollout: the trainer's state out, the engine woken, the new weights synced into it
    assert c.shift(DENSE7, Role.TRAIN, Role.ROLLOUT, 4) == pytest.approx(offload + wake + c.sync(DENSE7))
    # the rollout's engine to sleep, the judge's woken: no sync, the judge's weights do not change
    assert c.shift(DENSE7, Role.ROLLOUT, Role.JUDGE, 4) == pytest.approx(sleep + wake)
    assert c.shift(DENSE7, Role.JUDGE, Role.TRAIN, 4) == pytest.approx(sleep + onload)
    assert c.shift(DENSE7, None, Role.ROLLOUT, 4) == pytest.approx(wake + c.sync(DENSE7))
    assert c.shift(DENSE7, Role.JUDGE, Role.JUDGE, 4) == 0.0
    # a rollout engine kept awake still takes each version by the sync
    assert c.refresh(DENSE7, 4) == c.sync(DENSE7)
    # the compute is the roofline's
    roofline = RooflineCosts(GPUS["H100"])
    assert c.decode_step(DENSE7, 4, 64, 2000.0) == roofline.decode_step(DENSE7, 4, 64, 2000.0)


def test_deployed_sync_follows_the_published_refit_times():
    c = deployed()
    # NeMo-RL's refit: 4-5 s for an 8B model, 14-15 s for a 70B one; verl's Qwen3-MoE sync 37 s
    assert 4.0 <= c.sync(DENSE7) <= 5.0
    assert c.sync(DENSE7) < c.sync(DENSE14) < c.sync(MODELS["Qwen2.5-32B"]) < 10.0
    assert c.sync(MOE30) == 37.0
    # the judge's engine is put to sleep by its own size: a 32B judge takes longer than a 7B one
    big = deployed(genrm=MODELS["Qwen2.5-32B"])
    assert big.shift(DENSE7, Role.JUDGE, Role.TRAIN, 4) > c.shift(DENSE7, Role.JUDGE, Role.TRAIN, 4)
    # the trainer's state is sharded over the job's GPUs
    assert deployed(gpus=32).trainer_swap(DENSE7, True) == pytest.approx(4 * c.trainer_swap(DENSE7, True))


def test_deployed_costs_check_their_numbers():
    with pytest.raises(ValueError, match="wake_bw"):
        DeployedCosts(GPUS["H100"], wake_bw=0.0)
    with pytest.raises(ValueError, match="gpus"):
        DeployedCosts(GPUS["H100"], gpus=-1)


# -- what-ifs ---------------------------------------------------------------------------------


def test_scaled_costs_scale_role_changes_and_migrations_and_nothing_else():
    half = ScaledCosts(H100, shift_scale=0.5, migration_scale=0.0)
    assert isinstance(half, CostModel)
    assert half.shift(QWEN7, Role.ROLLOUT, Role.TRAIN, 4) == 0.5 * H100.shift(QWEN7, Role.ROLLOUT, Role.TRAIN, 4) > 0
    assert half.migration(QWEN7, 4, 3000) == 0.0 < H100.migration(QWEN7, 4, 3000)
    assert half.decode_step(QWEN7, 4, 64, 2048) == H100.decode_step(QWEN7, 4, 64, 2048)
    assert span_of(half, QWEN7, 4)(64, 2048, 100) == H100.decode_span(QWEN7, 4, 64, 2048, 100)
    assert half.prefill(QWEN7, 4, 4096, 512) == H100.prefill(QWEN7, 4, 4096, 512)
    assert half.refresh(QWEN7, 4) == H100.refresh(QWEN7, 4)  # a new version into a running engine is no shift
    assert half.optimizer_step(QWEN7, 8) == H100.optimizer_step(QWEN7, 8)
    assert half.kv_tokens(QWEN7, 4) == H100.kv_tokens(QWEN7, 4)
    with pytest.raises(ValueError, match="shift_scale: got -1, must be a finite number >= 0"):
        ScaledCosts(H100, shift_scale=-1)
