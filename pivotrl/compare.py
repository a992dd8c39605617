"""``pivotrl compare RUN_A RUN_B``: did two runs of one job learn the same thing?

Placement must not change what a job computes: with the same seeds, every
sequence's sampling is fixed by (job seed, step, sample), so two runs of one
job in different modes or on different device counts should produce the same
tokens, the same rewards and the same held-out accuracy. Floating-point sums
in a different order can flip a rare near-tie, after which that sequence (and,
through the update, later steps) may differ; this reports how much did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pivotrl.errors import UserError
from pivotrl.sim.measured import simulated
from pivotrl.telemetry import read_jsonl


@dataclass(slots=True)
class Comparison:
    samples: int = 0  # sequences present in both runs
    same_tokens: int = 0
    same_reward: int = 0
    first_difference: int | None = None  # the first step with a sequence whose tokens differ
    differing: list[tuple[int, int]] = field(default_factory=list)  # (step, uid) whose tokens differ
    only_in_one: int = 0  # sequences one run has and the other lacks
    accuracy: list[tuple[int, float, float]] = field(default_factory=list)  # (step, run a, run b)

    @property
    def token_match(self) -> float:
        return self.same_tokens / self.samples if self.samples else 0.0

    @property
    def reward_match(self) -> float:
        return self.same_reward / self.samples if self.samples else 0.0

    @property
    def max_accuracy_gap(self) -> float:
        return max((abs(a - b) for _, a, b in self.accuracy), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "same_tokens": self.same_tokens,
            "token_match": self.token_match,
            "same_reward": self.same_reward,
            "reward_match": self.reward_match,
            "first_difference": self.first_difference,
            "differing": [list(d) for d in self.differing],
            "only_in_one": self.only_in_one,
            "accuracy": [list(a) for a in self.accuracy],
            "max_accuracy_gap": self.max_accuracy_gap,
        }


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"{path}: not found (is {path.parent} a run directory written by `pivotrl train`?)")
    return [row for _, row in read_jsonl(path)]


def _tokens(row: dict[str, Any]) -> Any:
    """A sample's tokens; a simulated run records only their count."""
    return row["response_ids"] if "response_ids" in row else row.get("response_tokens")


def _samples(run: Path) -> dict[tuple[int, int], dict[str, Any]]:
    out = {}
    for row in _jsonl(run / "samples.jsonl"):
        try:
            out[(int(row["step"]), int(row["uid"]))] = row
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{run / 'samples.jsonl'}: every line needs integer 'step' and 'uid'") from None
    return out


def _accuracy(run: Path) -> dict[int, float]:
    curve = {}
    summary = run / "summary.json"
    if summary.is_file():
        start = json.loads(summary.read_text()).get("accuracy_start")
        if start is not None:
            curve[0] = float(start)
    for m in _jsonl(run / "metrics.jsonl"):
        if m.get("heldout_accuracy") is not None:
            curve[int(m["step"])] = float(m["heldout_accuracy"])
    return curve


def compare_runs(a: str | Path, b: str | Path) -> Comparison:
    """Sample-by-sample and evaluation-by-evaluation comparison of two run directories."""
    a, b = Path(a), Path(b)
    sa, sb = _samples(a), _samples(b)
    if simulated(a) != simulated(b):  # (a simulated sample has a token count, a real one tokens: never equal)
        sim, real = (a, b) if simulated(a) else (b, a)
        raise UserError(
            f"{sim} is a simulated run (`pivotrl simulate`) and {real} a run of `pivotrl train`: "
            "compare takes two runs of the same kind"
        )
    c = Comparison(only_in_one=len(sa.keys() ^ sb.keys()))
    for key in sorted(sa.keys() & sb.keys()):
        x, y = sa[key], sb[key]
        c.samples += 1
        if _tokens(x) == _tokens(y):
            c.same_tokens += 1
        else:
            c.differing.append(key)
            if c.first_difference is None:
                c.first_difference = key[0]
        c.same_reward += x["reward"] == y["reward"]
    acc_a, acc_b = _accuracy(a), _accuracy(b)
    c.accuracy = [(s, acc_a[s], acc_b[s]) for s in sorted(acc_a.keys() & acc_b.keys())]
    return c


def format_comparison(c: Comparison, a: str | Path, b: str | Path) -> str:
    lines = [f"A: {a}", f"B: {b}"]
    lines.append(
        f"samples: {c.same_tokens}/{c.samples} with identical tokens ({c.token_match:.2%}), "
        f"{c.same_reward}/{c.samples} identical rewards ({c.reward_match:.2%})"
        + (f"; {c.only_in_one} in one run only" if c.only_in_one else "")
    )
    if c.differing:
        steps = sorted({s for s, _ in c.differing})
        shown = ", ".join(map(str, steps[:12])) + (" ..." if len(steps) > 12 else "")
        lines.append(f"first difference at step {c.first_difference}; steps with a difference: {shown}")
    if c.accuracy:
        lines.append("held-out accuracy  step     A      B")
        lines += [f"{'':19}{s:>4}  {x:.3f}  {y:.3f}" for s, x, y in c.accuracy]
        lines.append(f"held-out accuracy: max |A - B| {c.max_accuracy_gap:.3f} over {len(c.accuracy)} evaluations")
    return "\n".join(lines)
