"""The planner's vocabulary in decision reasons: allocations, their changes, seconds."""

from __future__ import annotations

import math

from pivotrl.control.planner.alloc import fmt_alloc, fmt_delta, fmt_seconds
from tests.control.planner.cases import G, R, T


def test_an_allocation_reads_as_a_letter_and_a_count_per_role():
    assert fmt_alloc((3, 1, 0)) == "r3 j1 t0"
    assert fmt_alloc({T: 2, R: 1, G: 0}) == "r1 j0 t2"  # (in the roles' order, whatever the dict's)


def test_a_change_of_allocation_names_only_the_roles_it_changes():
    assert fmt_delta((3, 1, 0), (1, 1, 2)) == "rollout-2 train+2"
    assert fmt_delta((2, 2, 2), (2, 2, 2)) == ""


def test_seconds_read_with_two_decimals_and_never_as_inf():
    assert fmt_seconds(1.234) == "1.23s"
    assert fmt_seconds(math.inf) == "inf"
