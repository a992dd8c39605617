"""The bundled task: two-number addition, answered with a worked solution of
long-tailed length, judged against a reference.

Problems are ``a+b=`` with ``a, b`` in 0..99, zero-padded. The worked
solution moves one ten from ``b`` to ``a`` per step until ``b`` is below ten,
then writes the sum (all numbers at fixed width, so every step is a lookup at
a fixed distance)::

    37+68=  047+58 057+48 067+38 077+28 087+18 097+08 105

A problem whose ``b`` has ``t`` tens takes ``7 t + 4`` tokens. The data set
draws ``t`` with probability proportional to ``TAIL_RATIO ** t``: most
answers are a few tokens, a few run to 67. That long tail is what real RL
rollouts look like, and it is what shifting devices during a step is for.

The starting policy is trained by SFT on targets whose last step, when the
units digits carry, drops the carry most of the time (``097+08 095``). That
gives a policy that can already produce the right answer by sampling but
prefers a wrong one greedily: room for RL to improve, which a reward that
tells right from wrong can exploit. The judge is trained to read question,
reference and response, restate what it compares and give a verdict.

The data set (train and held-out splits, JSONL with ``question`` and
``reference``) is generated from a seed and ships under ``data/arithmetic``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pivotrl.sample import Problem
from pivotrl.task.rules import exact_match, extract_answer

HELDOUT_SIZE = 500
TRAIN_SIZE = 8000
TAIL_RATIO = 0.7  # P(b has t tens) is proportional to TAIL_RATIO ** t


def problem(a: int, b: int) -> Problem:
    return Problem(f"{a:02d}+{b:02d}=", str(a + b))


def operands(question: str) -> tuple[int, int]:
    a, b = question.rstrip("=").split("+")
    return int(a), int(b)


def make_splits(seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout), both long-tailed in the number of tens of ``b``.

    The held-out problems are distinct and never appear in train; train
    draws with repetition from the remaining problems, so its frequencies
    carry the length distribution.
    """
    rng = random.Random(seed)
    by_tens = [[(a, b) for a in range(100) for b in range(10 * t, 10 * t + 10)] for t in range(10)]
    for group in by_tens:
        rng.shuffle(group)
    weights = [TAIL_RATIO**t for t in range(10)]
    heldout = [by_tens[t].pop() for t in rng.choices(range(10), weights, k=HELDOUT_SIZE)]
    train = [rng.choice(by_tens[t]) for t in rng.choices(range(10), weights, k=TRAIN_SIZE)]
    return [problem(a, b) for a, b in train], [problem(a, b) for a, b in heldout]


def sft_pool(heldout: list[Problem]) -> list[Problem]:
    """Every problem outside the held-out set, once: what the starting models learn from."""
    held = {p.question for p in heldout}
    return [p for a in range(100) for b in range(100) if (p := problem(a, b)).question not in held]


def write_jsonl(problems: list[Problem], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"question": p.question, "reference": p.reference}) + "\n")


def worked_solution(a: int, b: int, answer: int | None = None) -> str:
    """The steps that move the tens of ``b`` onto ``a``, then ``answer`` (default: the sum)."""
    steps = [f"{a + 10 * i:03d}+{b - 10 * i:02d}" for i in range(1, b // 10 + 1)]
    return " ".join([*steps, f"{a + b if answer is None else answer:03d}"])


def policy_target(question: str, rng: random.Random, carry_drop: float) -> str:
    """SFT target for the starting policy: the worked solution, except that a
    units carry in the last step is dropped with probability ``carry_drop``."""
    a, b = operands(question)
    if (a % 10) + (b % 10) >= 10 and rng.random() < carry_drop:
        return worked_solution(a, b, a + b - 10)
    return worked_solution(a, b)


def judge_target(response: str, reference: str) -> str:
    """What the bundled judge is trained to write: a rationale, then the verdict.

    The rationale restates the final answer it read and the reference, both as
    three digits, then compares them digit by digit (``1=1 5#6 7=7``): each
    step is a lookup a small model learns quickly, where comparing whole
    numbers in one token is not.
    """
    answer = extract_answer(response)
    ref = reference.zfill(3)
    same = exact_match(response, reference)
    verdict = f"{'same' if same else 'differ'}. VERDICT: {'yes' if same else 'no'}"
    if answer is None or len(answer) > 3 or len(ref) > 3:
        return f"got {answer or 'none'} want {ref}: {verdict}"
    got = answer.zfill(3)
    pairs = " ".join(f"{g}{'=' if g == w else '#'}{w}" for g, w in zip(got, ref, strict=True))
    return f"got {got} want {ref}: {pairs} {verdict}"


def judge_training_response(question: str, reference: str, rng: random.Random) -> str:
    """A response for judge training: a worked solution ending right, off by the
    carry or otherwise wrong; one cut short; or garbage."""
    a, b = operands(question)
    total = a + b
    r = rng.random()
    if r < 0.4:
        answer = total
    elif r < 0.6:
        answer = total - 10 if total >= 10 else total + 10
    elif r < 0.8:  # one digit changed
        digits = list(f"{total:03d}")
        i = rng.randrange(3)
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
        answer = int("".join(digits))
    elif r < 0.86:
        answer = rng.randint(0, 199)
    elif r < 0.93:  # cut short, mid-solution
        full = worked_solution(a, b)
        return full[: rng.randint(0, len(full) - 1)]
    else:
        alphabet = "0123456789+=- abcxyz"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
    text = worked_solution(a, b, answer)
    if rng.random() < 0.1:  # the answer without its zero padding
        head, _, last = text.rpartition(" ")
        text = f"{head} {int(last)}".lstrip()
    return text
