"""Answer checkers on real cases: math-verify's symbolic comparison, the time limits that keep a response from
stalling a run, and garbage counted as incorrect, never raised."""

from __future__ import annotations

import threading
import time

import pytest

from pivotrl.config import ConfigError, load_config
from pivotrl.task import checkers
from pivotrl.task.checkers import CHECKERS, get_checker, math_match


@pytest.mark.parametrize(
    "response, reference",
    [
        (r"\boxed{1/2}", "0.5"),
        (r"The answer is $\boxed{\dfrac{3}{4}}$.", "0.75"),
        (r"so $x = 0.5$", r"\frac12"),
        (r"\boxed{2x+2}", "2(x+1)"),
        (r"$\frac{\sqrt{2}}{2}$", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{\pi/2}", r"\frac{\pi}{2}"),
        (r"\boxed{\{1,2\}}", r"\{2, 1\}"),
        (r"\boxed{50\%}", "0.5"),
        ("So the total is 1,000.", "1000"),
        (r"\boxed{7}", "$7$"),  # a reference with its own delimiters
        (r"\boxed{72}", "Natalia sold 48 clips ... #### 72"),  # a worked reference: its answer is extracted
        ("047+58 057+48 105", "105"),  # the bundled task's worked solution
    ],
)
def test_math_accepts_equal_answers(response: str, reference: str) -> None:
    assert math_match(response, reference)


@pytest.mark.parametrize(
    "response, reference",
    [
        (r"\boxed{0.333}", "1/3"),  # close is not equal
        (r"\boxed{2x+1}", "2(x+1)"),
        (r"\boxed{B}", "A"),
        ("047+58 057+48 095", "105"),
    ],
)
def test_math_rejects_different_answers(response: str, reference: str) -> None:
    assert not math_match(response, reference)


@pytest.mark.parametrize(
    "response",
    ["", "blah blah", r"\boxed{1/2", "\x00\\\\\\{{{}", "}}}$$$\\frac{", r"\boxed{\frac{1}{0}}", "9" * 5000, "ß∂" * 999],
)
def test_math_counts_garbage_as_incorrect(response: str) -> None:
    assert math_match(response, "1") is False


def test_math_gives_up_on_an_expression_a_naive_parser_would_evaluate_forever(monkeypatch) -> None:
    """A power tower has more digits than atoms in the universe: evaluating it never ends. The
    comparison's time limit (1 s here) makes it an incorrect answer instead of a hung run."""
    monkeypatch.setattr(checkers, "MATH_TIMEOUT_S", 1)
    started = time.monotonic()
    assert not math_match(r"\boxed{9^{9^{9^{9^{9}}}}}", "1")
    assert time.monotonic() - started < 10  # a few limits' worth at most (parse, then each comparison)
    assert math_match(r"\boxed{1/2}", "0.5")  # and the next one is checked as usual


def test_math_counts_an_error_inside_math_verify_as_incorrect(monkeypatch) -> None:
    import math_verify

    def broken(*args, **kwargs):
        raise RecursionError("deep")

    monkeypatch.setattr(math_verify, "parse", broken)
    assert math_match(r"\boxed{1/2}", "0.5") is False


def test_math_outside_the_main_thread_counts_incorrect_instead_of_running_without_limits() -> None:
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(math_match(r"\boxed{1/2}", "0.5")))
    worker.start()
    worker.join()
    assert result == [False]


def test_exact_is_the_bundled_tasks_checker() -> None:
    exact = get_checker("exact")
    assert exact("047+58 105", "105") and exact("085", "85")
    assert not exact(r"\boxed{1/2}", "0.5")  # what math is for


def test_an_unknown_checker_names_the_ones_there_are() -> None:
    with pytest.raises(ValueError, match="unknown checker 'sympy' \\(allowed: exact, math\\)"):
        get_checker("sympy")
    with pytest.raises(ConfigError, match="task.checker: expected one of exact, math, got 'sympy'"):
        load_config(None, ["task.checker=sympy"])


def test_a_registered_checker_is_a_config_choice(monkeypatch) -> None:
    def last_letter(response: str, reference: str) -> bool:
        return response.strip()[-1:].upper() == reference.strip().upper()

    monkeypatch.setitem(CHECKERS, "choice", last_letter)
    assert load_config(None, ["task.checker=choice"]).task.checker == "choice"
    assert get_checker("choice")("the answer is b", "B")
