"""KV-cache sizing from a memory budget: the arithmetic case by case and the error naming the key.

The engine under a budget is tested with the engine (tests/engine/test_engine.py)."""

import pytest
import torch

from pivotrl.engine.kv_budget import (
    AUTO_FRACTION,
    GB,
    KEY,
    KVBudget,
    KVBudgetError,
    auto_budget,
    bytes_per_token,
    check_fits,
)
from pivotrl.errors import UserError
from tests.conftest import tiny_config

CFG = tiny_config("LlamaForCausalLM", 24)  # 2 layers, 2 kv heads, head_dim 8
PER_TOKEN = 2 * 2 * 2 * 8 * 4  # k and v x layers x kv heads x head_dim x 4 bytes (fp32)


def test_bytes_per_token() -> None:
    assert bytes_per_token(CFG, torch.float32) == PER_TOKEN
    assert bytes_per_token(CFG, torch.bfloat16) == PER_TOKEN // 2


@pytest.mark.parametrize(
    ("budget", "max_batch", "slots"),
    [
        pytest.param(None, 64, 64, id="no-budget-max-batch"),
        pytest.param(10 * 100 * PER_TOKEN, 64, 10, id="budget-holds-ten"),
        pytest.param(10 * 100 * PER_TOKEN - 1, 64, 9, id="a-byte-short-of-ten"),
        pytest.param(10**12, 64, 64, id="large-budget-capped-by-max-batch"),
        pytest.param(100 * PER_TOKEN, 64, 1, id="exactly-one-sequence"),
    ],
)
def test_slots_from_budget(budget: int | None, max_batch: int, slots: int) -> None:
    plan = KVBudget(budget).plan(CFG, torch.float32, 100, max_batch)
    assert plan.slots == slots and plan.max_len == 100
    assert plan.nbytes == slots * 100 * PER_TOKEN and plan.tokens == slots * 100
    assert budget is None or plan.nbytes <= budget


@pytest.mark.parametrize("explicit", [True, False])
def test_budget_below_one_sequence_names_the_key(explicit: bool) -> None:
    budget = KVBudget(100 * PER_TOKEN - 1, explicit, weights_bytes=3 * GB)
    with pytest.raises(KVBudgetError) as info:
        budget.plan(CFG, torch.float32, 100, 64)
    msg = str(info.value)
    assert isinstance(info.value, UserError)  # reported as one line, exit status 2
    assert msg.startswith(f"{KEY}:") and "one sequence of 100 tokens" in msg and "weights (3 GB)" in msg
    assert ("auto" in msg) != explicit
    # half the bytes per token: the same budget holds a sequence in bf16
    assert budget.plan(CFG, torch.bfloat16, 100, 64).slots == 1


@pytest.mark.parametrize(
    ("free", "total", "held", "share", "expected"),
    [
        pytest.param(60 * GB, 80 * GB, 20 * GB, 1.0, AUTO_FRACTION * 60 * GB, id="free-memory"),
        pytest.param(60 * GB, 80 * GB, 10 * GB, 0.25, AUTO_FRACTION * 10 * GB, id="its-quarter-of-a-shared-gpu"),
        pytest.param(5 * GB, 80 * GB, 10 * GB, 0.5, AUTO_FRACTION * 5 * GB, id="others-took-the-rest"),
        pytest.param(60 * GB, 80 * GB, 30 * GB, 0.25, 0, id="weights-beyond-its-share"),
    ],
)
def test_auto_budget(free: int, total: int, held: int, share: float, expected: float) -> None:
    assert auto_budget(free, total, held, share) == int(expected)


def test_auto_budget_rejects_a_share_outside_0_1() -> None:
    with pytest.raises(ValueError, match="share"):
        auto_budget(1, 1, 0, 1.5)


def test_an_explicit_budget_the_device_cannot_hold_is_refused() -> None:
    plan = KVBudget(10 * GB, True).plan(CFG, torch.float32, 100, 64)
    check_fits(plan, plan.nbytes)  # exactly enough: fine
    with pytest.raises(KVBudgetError, match=rf"{KEY}=10: .* needs .* GB but the device has"):
        check_fits(plan, plan.nbytes - 1)
