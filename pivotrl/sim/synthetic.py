"""Stand-ins for what real models read and write, with the right sizes and outcomes.

The simulator never decodes text, but the control plane reads some: the rule
checker extracts an answer from a response, the GenRM parses a verdict from a
judgment. So every simulated sequence gets placeholder token ids of the right
count, and a short text that the job's own parsers read the way the draw says.

Every draw is a pure function of (job seed, sequence seed, uid, purpose): a
sequence gets the same length and the same verdict on any device, after any
migration, in any mode. Correctness is a coin of probability
``yes_probability``; the judge agrees with it (the simulated judge is perfect),
so held-out accuracy and judge agreement in a simulation describe the coin,
not a policy: they are not meaningful.
"""

from __future__ import annotations

import re
from re import _parser as sre  # the stdlib's own regex parser: walks a pattern to write a text it matches
from typing import Any

from pivotrl.reward.genrm import GenRM
from pivotrl.sample import Problem

_MASK = (1 << 64) - 1
LENGTH, VERDICT, GROUP_LENGTH, SPREAD, JUDGE_LENGTH = 1, 2, 3, 4, 5  # purposes of a draw: independent streams
REFERENCE, RIGHT, WRONG = "1", "1", "0"  # the synthetic problems' answer; a response ends with one of these
_TOKENS = re.compile(r"^\[(\d+) tokens\] ")


def unit(*keys: int) -> float:
    """A uniform number in [0, 1) fixed by ``keys`` (splitmix64 over their mix)."""
    x = 0
    for k in keys:
        x = (x * 0x9E3779B97F4A7C15 + k + 0x632BE59BD9B4E019) & _MASK
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _MASK
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return (x >> 11) / (1 << 53)


def problems(n: int, tag: str = "p") -> list[Problem]:
    """``n`` stand-in problems; the simulator prices every prompt at ``sim.prompt_len`` tokens, whatever its text."""
    return [Problem(f"{tag}{i}", REFERENCE) for i in range(n)]


def response_text(tokens: int, right: bool) -> str:
    """A response the rule checker reads as right or wrong; it carries its token count for the judge."""
    return f"[{tokens} tokens] answer {RIGHT if right else WRONG}"


def response_tokens(text: str) -> int:
    """Tokens of a response: the count ``response_text`` wrote, else one per word."""
    m = _TOKENS.match(text)
    return int(m.group(1)) if m else len(text.split())


def verdict_text(genrm: GenRM, label: str) -> str | None:
    """A short judgment that ``judge`` parses to ``label`` (its verdict pattern's group), or None."""
    candidates = []
    for one in (True, False):
        try:
            candidates.append(_render(sre.parse(genrm.pattern.pattern, genrm.pattern.flags), label, one))
        except (ValueError, re.error, IndexError):
            pass
    candidates += [f"VERDICT: {label}", label]
    for text in candidates:
        j = genrm.score(text)
        if j.label == label and j.reward == genrm.rewards.get(label):
            return text
    return None


def _render(items: Any, label: str, once: bool) -> str:
    """A string matching parsed pattern ``items`` with group 1 as ``label``; optional parts are
    written ``once`` or left out."""
    out = []
    for op, arg in items:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name == "NOT_LITERAL":
            out.append("x" if chr(arg) != "x" else "y")
        elif name == "ANY":
            out.append("x")
        elif name == "IN":
            out.append(_one_of(arg))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = arg
            n = lo if lo or not once else min(1, hi)
            out.append(_render(sub, label, once) * n)
        elif name == "SUBPATTERN":
            group, _, _, sub = arg
            out.append(label if group == 1 else _render(sub, label, once))
        elif name == "BRANCH":
            out.append(_render(arg[1][0], label, once))
        elif name == "ATOMIC_GROUP":
            out.append(_render(arg, label, once))
        elif name in ("AT", "ASSERT", "ASSERT_NOT"):
            continue
        else:
            raise ValueError(f"cannot write {name}")
    return "".join(out)


def _one_of(items: Any) -> str:
    op, arg = items[0]
    name = str(op)
    if name == "LITERAL":
        return chr(arg)
    if name == "RANGE":
        return chr(arg[0])
    if name == "CATEGORY":
        return {"CATEGORY_DIGIT": "0", "CATEGORY_SPACE": " ", "CATEGORY_WORD": "a"}.get(str(arg), "x")
    raise ValueError(f"cannot write a member of {name}")
