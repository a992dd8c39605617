import random
from pathlib import Path

import pytest

from pivotrl.task.arithmetic import (
    HELDOUT_SIZE,
    TRAIN_SIZE,
    judge_target,
    judge_training_response,
    make_splits,
    operands,
    policy_target,
    sft_pool,
    worked_solution,
)
from pivotrl.task.data import DataError, read_jsonl
from pivotrl.task.rules import exact_match, extract_answer

ROOT = Path(__file__).resolve().parents[2]


def test_splits_are_disjoint_and_long_tailed() -> None:
    train, heldout = make_splits(0)
    assert len(heldout) == HELDOUT_SIZE == len({p.question for p in heldout}) and len(train) == TRAIN_SIZE
    assert not {p.question for p in train} & {p.question for p in heldout}
    for p in train[:50]:
        a, b = operands(p.question)
        assert p.reference == str(a + b) and p.question == f"{a:02d}+{b:02d}="
    lengths = sorted(len(worked_solution(*operands(p.question))) for p in train)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert lengths[0] == 3 and lengths[-1] == 66 and p99 >= 5 * median  # most answers short, a few long


def test_sft_pool_is_everything_but_the_heldout() -> None:
    _, heldout = make_splits(0)
    pool = sft_pool(heldout)
    assert len(pool) == 10_000 - HELDOUT_SIZE and not {p.question for p in pool} & {p.question for p in heldout}


@pytest.mark.parametrize(
    "a, b, text",
    [(45, 3, "048"), (7, 12, "017+02 019"), (37, 68, "047+58 057+48 067+38 077+28 087+18 097+08 105")],
)
def test_worked_solution(a: int, b: int, text: str) -> None:
    assert worked_solution(a, b) == text and extract_answer(text) == str(a + b)


def test_shipped_data_is_the_seeded_split() -> None:
    train, heldout = make_splits(0)
    assert read_jsonl(ROOT / "data/arithmetic/train.jsonl") == train
    assert read_jsonl(ROOT / "data/arithmetic/heldout.jsonl") == heldout


def test_read_jsonl_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        read_jsonl(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1="}\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 1: no field 'reference' \(task.reference_field"):
        read_jsonl(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no problems"):
        read_jsonl(empty)


@pytest.mark.parametrize(
    "response, expected",
    [("85", "85"), (" 085\n", "85"), ("the answer is 12, no 13", "13"), ("", None), ("abc", None), ("-5", "-5")],
)
def test_extract_answer(response: str, expected: str | None) -> None:
    assert extract_answer(response) == expected


def test_exact_match() -> None:
    assert exact_match("85", "85") and exact_match("085", "85")
    assert not exact_match("75", "85") and not exact_match("", "85") and not exact_match("8 5", "85")


def test_policy_target_drops_carry_at_the_configured_rate() -> None:
    rng = random.Random(0)
    wrong = sum(policy_target("47+38=", rng, 0.65) == "057+28 067+18 077+08 075" for _ in range(4000)) / 4000
    assert 0.62 < wrong < 0.68
    assert all(policy_target("41+38=", rng, 1.0) == worked_solution(41, 38) for _ in range(100))  # no carry


@pytest.mark.parametrize(
    "response, reference, text",
    [
        ("45", "45", "got 045 want 045: 0=0 4=4 5=5 same. VERDICT: yes"),
        ("017+02 019", "19", "got 019 want 019: 0=0 1=1 9=9 same. VERDICT: yes"),
        ("017+02", "19", "got 002 want 019: 0=0 0#1 2#9 differ. VERDICT: no"),
        ("35", "45", "got 035 want 045: 0=0 3#4 5=5 differ. VERDICT: no"),
        ("zz", "45", "got none want 045: differ. VERDICT: no"),
        ("1234", "45", "got 1234 want 045: differ. VERDICT: no"),
    ],
)
def test_judge_target(response: str, reference: str, text: str) -> None:
    assert judge_target(response, reference) == text
    assert len(text.split("VERDICT")[0]) >= 8  # a rationale of at least 8 tokens precedes the verdict


def test_judge_training_responses_cover_right_and_wrong() -> None:
    rng = random.Random(1)
    responses = [judge_training_response("47+38=", "85", rng) for _ in range(2000)]
    right = sum(exact_match(r, "85") for r in responses) / len(responses)
    assert 0.35 < right < 0.5
    assert "057+28 067+18 077+08 075" in responses and any(extract_answer(r) is None for r in responses)
    assert any(r.endswith(" 85") for r in responses)  # some answers without their zero padding
    assert any(r and worked_solution(47, 38).startswith(r) and not exact_match(r, "85") for r in responses)  # cut
