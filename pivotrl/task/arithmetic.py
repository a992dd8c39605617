"""The bundled task: two-number addition with a reference answer.

Problems are ``a+b=`` with ``a, b`` in 0..99; the reference is the sum. The
data set (train and held-out splits, JSONL with ``question`` and
``reference``) is generated from a seed and ships under ``data/arithmetic``.

The starting policy is trained by SFT on targets that, on problems whose
units digits carry, drop the carry most of the time (``47+38=75``). That
gives a policy that can already produce the right answer by sampling but
prefers a wrong one greedily: room for RL to improve, which a reward that
tells right from wrong can exploit. The judge is trained to read question,
reference and response, restate what it compares and give a verdict.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from pivotrl.task.rules import exact_match, extract_answer

HELDOUT_SIZE = 500


@dataclass(slots=True, frozen=True)
class Problem:
    question: str
    reference: str


def all_problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(100) for b in range(100)]


def make_splits(seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout): a seeded shuffle of all 10,000 problems, 500 held out."""
    pairs = all_problems()
    random.Random(seed).shuffle(pairs)
    problems = [Problem(f"{a:02d}+{b:02d}=", str(a + b)) for a, b in pairs]
    return problems[HELDOUT_SIZE:], problems[:HELDOUT_SIZE]


def write_jsonl(problems: list[Problem], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"question": p.question, "reference": p.reference}) + "\n")


def read_jsonl(path: str | Path) -> list[Problem]:
    """Read a task file; every line needs ``question`` and ``reference`` strings."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {str(path)!r} not found")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(Problem(str(row["question"]), str(row["reference"])))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected a JSON object with 'question' and 'reference' ({e})") from None
    if not out:
        raise ValueError(f"{path}: no problems")
    return out


def operands(question: str) -> tuple[int, int]:
    a, b = question.rstrip("=").split("+")
    return int(a), int(b)


def policy_target(question: str, rng: random.Random, carry_drop: float) -> str:
    """SFT target for the starting policy: correct, except that a units carry
    is dropped with probability ``carry_drop``."""
    a, b = operands(question)
    if (a % 10) + (b % 10) >= 10 and rng.random() < carry_drop:
        return str(a + b - 10)
    return str(a + b)


def judge_target(response: str, reference: str) -> str:
    """What the bundled judge is trained to write: a rationale, then the verdict.

    The rationale restates the answer it read and the reference, both as three
    digits, then compares them digit by digit (``1=1 5#6 7=7``): each step is a
    lookup a small model learns quickly, where comparing whole numbers in one
    token is not.
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
    """A response for judge training: right, off by the carry, wrong, or garbage."""
    a, b = operands(question)
    r = rng.random()
    if r < 0.4:
        return reference
    if r < 0.6:
        return str(a + b - 10) if a + b >= 10 else str(a + b + 10)
    if r < 0.85:  # one digit changed
        digits = list(reference)
        i = rng.randrange(len(digits))
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
        return str(int("".join(digits)))
    if r < 0.93:
        return str(rng.randint(0, 199))
    alphabet = "0123456789+=- abcxyz"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
