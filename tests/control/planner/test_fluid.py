"""The fluid model: work done by devices joining over time, case by case."""

from __future__ import annotations

import math

import pytest

from pivotrl.control.planner.fluid import drain, fifo, fluid, left_at


def test_work_left_at_a_time_of_a_fifo():
    one = [(0.0, 1)]
    assert left_at([(0.0, 10.0), (2.0, 10.0)], one, lambda n: 1.0, 5.0) == pytest.approx(15.0)
    # a second device from t = 1: 1 done by then, 2 by t = 2 (10 more come), 2 by t = 3
    assert left_at([(0.0, 10.0), (2.0, 10.0)], [*one, (1.0, 1)], lambda n: 1.0, 3.0) == pytest.approx(15.0)
    assert left_at([(4.0, 10.0)], one, lambda n: 1.0, 3.0) == 0.0  # nothing released yet


def test_fifo_pieces_end_in_order_as_devices_join():
    # 2 devices at 1/s from 0, 2 more at 10: 10 units now end at 5; 20 released at 6: 8 by 10, the
    # other 12 by 4 devices in 3 s;
    # a piece released after everything is done starts at its release; no devices: never
    out = fifo([(0.0, 10.0), (6.0, 20.0), (30.0, 4.0)], [(0.0, 2), (10.0, 2)], lambda n: 1.0)
    assert out == pytest.approx([5.0, 13.0, 31.0])
    assert fifo([(0.0, 1.0)], [], lambda n: 1.0) == [math.inf]
    assert fifo([(0.0, 0.0), (2.0, 0.0)], [(0.0, 1)], lambda n: 1.0) == [0.0, 2.0]


def test_drain_shares_the_work_among_devices_as_they_join():
    # 10 units, 1 device at 1/s from 0, a second at 4: 4 done by then, the other 6 at 2/s in 3 s
    assert drain(10.0, lambda n: 1.0, [(0.0, 1), (4.0, 1)]) == pytest.approx(7.0)
    # done before the second device comes: it changes nothing
    assert drain(3.0, lambda n: 1.0, [(0.0, 1), (4.0, 1)]) == pytest.approx(3.0)
    # each of n devices sharing the work is slower the more there are: 2 at 0.75/s do 1.5/s
    assert drain(3.0, lambda n: 1.0 if n == 1 else 0.75, [(0.0, 2)]) == pytest.approx(2.0)


def test_drain_of_nothing_is_at_once_and_of_work_without_devices_never():
    assert drain(0.0, lambda n: 1.0, []) == 0.0
    assert drain(5.0, lambda n: 1.0, []) == math.inf
    # devices that never come, or none at all, do nothing
    assert drain(5.0, lambda n: 1.0, [(math.inf, 3), (1.0, 0)]) == math.inf


def test_fluid_work_released_over_time_is_done_in_any_order_as_fast():
    # 4 units at 0 and 4 more at 10 on 2 devices at 1/s: the first done by 2, the second by 12
    assert fluid([(10.0, 4.0), (0.0, 4.0)], [(0.0, 2)], 1.0) == pytest.approx(12.0)
    # released together: the same as draining it all from the start
    assert fluid([(0.0, 4.0), (0.0, 4.0)], [(0.0, 2)], 1.0) == pytest.approx(drain(8.0, lambda n: 1.0, [(0.0, 2)]))
    assert fluid([(3.0, 0.0)], [(0.0, 1)], 1.0) == 0.0  # nothing to do
