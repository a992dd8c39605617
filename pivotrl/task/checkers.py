"""Answer checkers: is a response's answer the reference's? (``task.checker``)

A checker is a plain function ``(response_text, reference) -> bool``. It
never produces training rewards (the judge does); it measures the policy's
accuracy (held-out evaluation, each sample's ``correct``) and the judge's
agreement with it. The controller gets the function through ``LoopSpec.check``
and knows nothing else about the task, so a checker may use any library
without the control plane importing it.

- ``exact``: the last integer of the response equals the reference's (the
  bundled arithmetic task).
- ``math``: both parsed by ``math-verify`` (LaTeX such as ``\\boxed{\\frac12}``,
  or plain expressions) and compared symbolically and numerically, so
  ``\\boxed{1/2}`` equals ``0.5`` and ``2x+2`` equals ``2(x+1)``.

A checker must return, never raise or hang: a response is model output, and
garbage is the common case early in training. ``math`` counts any error, a
parse or a comparison past its time limit, or a response it cannot read as
incorrect.

To add one, write the function and register it under a name::

    def choice(response: str, reference: str) -> bool:
        return response.strip()[-1:].upper() == reference.strip().upper()

    CHECKERS["choice"] = choice

before the config is loaded (``task.checker=choice``); the config accepts
exactly the names registered here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pivotrl.log import logger
from pivotrl.task.rules import exact_match

Checker = Callable[[str, str], bool]

# math-verify's limits: seconds for parsing one text and for one comparison (its timeouts are whole seconds, by
# SIGALRM), and the characters of a response read (its tail, where the final answer is)
MATH_TIMEOUT_S = 2
MATH_MAX_CHARS = 10_000
_DELIMITED = ("$", "\\boxed", "\\(", "\\[")  # a reference with these is text around a formula, not the formula
_warned_thread = False


def math_match(response: str, reference: str) -> bool:
    """``response`` states an answer equal to ``reference``, by ``math-verify``; False on anything it cannot do.

    The reference is the answer itself, so it is read whole as a LaTeX formula
    (``2(x+1)``, ``\\frac12``) unless it carries its own delimiters, or reads
    as no formula, when ``math-verify`` extracts the answer from it as from a
    response. The timeouts use SIGALRM, which works in the main thread only;
    elsewhere a response counts as incorrect, with a warning, rather than run
    with no limit on a parse that may never end.
    """
    global _warned_thread
    if threading.current_thread() is not threading.main_thread():
        if not _warned_thread:
            logger.warning("task.checker=math runs its time limits in the main thread only; counting as incorrect")
            _warned_thread = True
        return False
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = []
        if not any(d in reference for d in _DELIMITED):
            gold = parse(f"${reference}$", [LatexExtractionConfig()], parsing_timeout=MATH_TIMEOUT_S)
        if not any(not isinstance(g, str) for g in gold):
            gold = parse(reference, parsing_timeout=MATH_TIMEOUT_S)
        answer = parse(response[-MATH_MAX_CHARS:], parsing_timeout=MATH_TIMEOUT_S)
        return bool(gold and answer and verify(gold, answer, timeout_seconds=MATH_TIMEOUT_S))
    except (Exception, TimeoutException) as e:  # (math-verify's timeout is a BaseException)
        logger.debug("task.checker=math: %s: %s", type(e).__name__, e)
        return False


CHECKERS: dict[str, Checker] = {"exact": exact_match, "math": math_match}


def get_checker(name: str) -> Checker:
    """The checker registered as ``name``; an unknown name is an error listing those there are."""
    try:
        return CHECKERS[name]
    except KeyError:
        raise ValueError(f"checker: unknown checker {name!r} (allowed: {', '.join(CHECKERS)})") from None
