"""Live statistics, alone: running means, whole-step lengths, what a running judgment has left."""

from __future__ import annotations

import pytest

from pivotrl.control.live import LiveStats
from pivotrl.control.messages import Generated, GenResult, Judged, JudgeResult, Trained
from pivotrl.sample import Sample


def sample(uid: int, prompt: int, response: int, judge: int) -> Sample:
    return Sample(uid, 0, "q", "r", [1] * prompt, 0, response_ids=[2] * response, judge_tokens=judge)


def test_priors_until_measured_then_running_means():
    stats = LiveStats(judge_max_new_tokens=100, rollout_max_new_tokens=40)
    assert stats.means == {"judge_tokens": 50.0, "response_tokens": 20.0, "prompt_tokens": 16.0,
                           "step_seconds": 0.1, "judge_reread": 1.0}  # fmt: skip
    stats.observe(Generated(0, (GenResult(0, [1] * 26, [2], [0.0], "", "stop", 0),)))
    assert stats.means["prompt_tokens"] == pytest.approx(16 + 0.2 * 10)
    stats.observe(Judged(1, (JudgeResult(0, "", False, 10), JudgeResult(1, "", False, 30))))
    stats.observe(Judged(1, (JudgeResult(2, "", False, 50),)))
    assert stats.means["judge_tokens"] == pytest.approx(30.0)  # the judgments seen, before any step
    stats.observe(Trained((2,), 1, {}, 2.0, 0, 1.5))
    assert stats.means["step_seconds"] == pytest.approx(0.1 + 0.2 * (0.5 - 0.1))  # the update alone


def test_a_trained_step_sets_its_means_and_what_a_running_judgment_has_left():
    stats = LiveStats(100, 40)
    assert stats.verdict_left(2) == 48  # no step yet: the prior mean less what it wrote
    samples = [sample(u, 8, 2, 5 + 90 * (u % 2)) for u in range(4)]
    stats.step_trained(samples, judge_prefill_tokens=3 * 4 * 10)
    assert stats.means["judge_tokens"] == 50 and stats.means["response_tokens"] == 2
    assert stats.means["judge_reread"] == pytest.approx(3.0) and stats.judgments == [5, 5, 95, 95]
    assert [stats.verdict_left(n) for n in (0, 2, 10, 94, 95, 500)] == pytest.approx([50, 48, 85, 1, 1, 1])
    stats.observe(Judged(1, (JudgeResult(0, "", False, 1000),)))  # a step's mean from now on
    assert stats.means["judge_tokens"] == 50
    restored = LiveStats(100, 40)
    restored.restore(dict(stats.means), stats.judgments)
    assert restored.means == stats.means and restored.verdict_left(10) == pytest.approx(85)


def test_progress_is_kept_until_its_sequence_ends():
    stats = LiveStats(100, 40)
    stats.progress(((1, 10), (2, 20)))
    stats.progress(((1, 12),))
    stats.ended(2)
    stats.ended(3)  # (nothing written: nothing to forget)
    assert stats.so_far == {1: 12}
