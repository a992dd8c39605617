"""Rule-based exact-match checker. It never produces training rewards (the
judge does); it measures the judge's agreement and the policy's accuracy."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def extract_answer(response: str) -> str | None:
    """The last integer in the response, normalised (``"007"`` -> ``"7"``), or None."""
    found = _INT.findall(response)
    return str(int(found[-1])) if found else None


def exact_match(response: str, reference: str) -> bool:
    answer = extract_answer(response)
    ref = extract_answer(reference)
    return answer is not None and answer == ref
