import copy

import pytest

from pivotrl.control.messages import Role
from pivotrl.sim.costs import CostModel
from pivotrl.sim.measured import REQUIRED_SHIFTS, MeasuredCosts
from pivotrl.sim.models import ModelSpec

POLICY = ModelSpec("policy", 1e6, 1e6, 2, 64, 4, 2, 16, 100, True)
GENRM = ModelSpec("genrm", 2e6, 2e6, 2, 64, 4, 2, 16, 100, True)
GEN = {"step_base_s": 0.004, "step_per_seq_s": 2e-4, "step_per_kv_token_s": 1e-7, "prefill_per_token_s": 5e-5}
PROFILE = {
    "device": "cpu, 1 torch thread",
    "rollout": {"model": "policy", **GEN, "max_batch": 64, "max_len": 256},
    "genrm": {"model": "genrm", **GEN, "step_base_s": 0.006, "max_batch": 32, "max_len": 512},
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
        (("shift", "genrm->train"), "shift.genrm->train: missing key"),
        (("genrm",), "genrm: missing key"),
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
        ({"genrm": {**PROFILE["genrm"], "model": "policy"}}, "must differ"),
        ({"extra": 1}, "extra: unknown key"),
    ],
)
def test_a_bad_value_is_named(change, message):
    with pytest.raises(ValueError, match=message):
        costs(**change)


def test_load_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"rollout": {}}')
    with pytest.raises(ValueError, match="bad.json: genrm: missing key"):
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
    into = [PROFILE["shift"]["genrm->train"], PROFILE["shift"]["rollout->train"]]
    assert c.shift(POLICY, None, Role.TRAIN, 1) == pytest.approx(sum(into) / 2)
    measured = costs(shift={**PROFILE["shift"], "none->train": 9.0})
    assert measured.shift(POLICY, None, Role.TRAIN, 1) == 9.0
