"""A finished step's metrics row (what metrics.jsonl holds), from its record alone, and the rows going out in order."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Container
from typing import Any

from pivotrl.control.book import StepRecord

MISMATCH = "logprob_mismatch"


def step_metrics(rec: StepRecord, top_reward: float, max_staleness: int = 0) -> dict[str, Any]:
    """The metrics of a trained step; ``top_reward`` is the judge's reward for a correct verdict (the judge agrees
    with the task's checker where a correct response got it and a wrong one did not). Where steps overlap
    (``max_staleness`` > 0), how many versions its samples lag behind the one it trains."""
    samples, n = rec.samples, len(rec.samples)
    lags = Counter(rec.step - 1 - s.policy_version for s in samples) if max_staleness else Counter()
    resp_tokens = sum(len(s.response_ids) for s in samples)
    seconds = (rec.finished or rec.started) - rec.started
    return {
        "step": rec.step,
        "reward_mean": sum(s.reward for s in samples) / n,
        "accuracy": sum(bool(s.correct) for s in samples) / n,
        "judge_agreement": sum((s.reward >= top_reward) == bool(s.correct) for s in samples) / n,
        "parse_failures": rec.judge_stats.parse_failures,
        "judge_outcomes": dict(rec.judge_stats.by_outcome),
        "response_length": resp_tokens / n,
        "truncated": sum(s.truncated for s in samples),
        "response_tokens": resp_tokens,
        "judge_tokens": rec.judge_tokens,
        "step_seconds": seconds,
        "samples_per_s": n / seconds if seconds > 0 else 0.0,
        "tokens_per_s": (resp_tokens + rec.judge_tokens) / seconds if seconds > 0 else 0.0,
        "time_s": phase_times(rec),
        # how long groups wait for the judge once generated whole (their backward waits as long), and how
        # many could train when the rollout ended: where a step's time after its rollout comes from
        "group_wait_s": quantiles(rec.group_waits),
        "groups_judged_at_rollout_end": rec.groups_judged_at_rollout_end,
        "shifts": rec.shifts,
        "migrations": rec.migrations,
        "recovered": rec.recovered,
        "shift_seconds": rec.shift_seconds,
        **{f"train_{k}": v for k, v in rec.train_stats.items() if k != MISMATCH},
        # mean |trainer - engine| log-prob of the step's response tokens (the engine's numerical drift)
        **({MISMATCH: rec.train_stats[MISMATCH]} if MISMATCH in rec.train_stats else {}),
        **(
            {
                "staleness_max": max(lags),
                "staleness_mean": sum(lag * c for lag, c in lags.items()) / n,
                "staleness": {str(lag): lags[lag] for lag in sorted(lags)},  # samples by versions behind
                # when it began, its rollout and its judging ended and its update landed, on the run's clock:
                # overlapping steps' own times overlap (the spacing of their updates is the rate); the trace and
                # the timeline draw each step's span from these
                "at_s": {
                    "start": rec.started,
                    "rollout_end": rec.rollout_end,
                    "judge_end": rec.judge_end,
                    "end": rec.finished or rec.started,
                },
            }
            if lags
            else {}
        ),
    }


def quantiles(values: list[float]) -> dict[str, float]:
    """Median, 90th percentile (interpolated between the values) and maximum of ``values``; zeros for none."""
    if len(values) < 2:
        x = values[0] if values else 0.0
        return {"median": x, "p90": x, "max": x}
    p90 = statistics.quantiles(values, n=10, method="inclusive")[-1]
    return {"median": statistics.median(values), "p90": p90, "max": max(values)}


def phase_times(rec: StepRecord) -> dict[str, float]:
    """Wall time of each phase of a step. Phases may overlap (judging streams
    while rollout runs), so they need not add up to the step time."""
    end = rec.finished or rec.started
    rollout_end = rec.rollout_end or end
    judge_end = rec.judge_end or end
    return {
        "rollout": rollout_end - rec.started,
        "judge": judge_end - (rec.first_judged or rollout_end),
        "train": end - (rec.train_start or end),
        "step": end - rec.started,
    }


class StepReports:
    """Finished steps' metrics waiting for their evaluation (``pending``: step -> row): a step's row goes out once
    every step before it has gone out and its evaluation, if one is due, is in (with its held-out accuracy)."""

    def __init__(self, last_step: int) -> None:
        self.last_step = last_step
        self.pending: dict[int, dict[str, Any]] = {}

    def add(self, step: int, row: dict[str, Any]) -> None:
        self.pending[step] = row

    def emit(self, out: list[dict[str, Any]], evaluating: Container[int], accuracy: dict[int, float]) -> bool:
        """Append to ``out`` the rows that may go out, in step order; True when the last step's went out."""
        last = False
        while self.pending:
            step = min(self.pending)
            if step in evaluating:  # its evaluation is still running
                break
            row = self.pending.pop(step)
            if step in accuracy:
                row["heldout_accuracy"] = accuracy[step]
            out.append(row)
            last |= step == self.last_step
        return last
