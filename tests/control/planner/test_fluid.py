"""The fluid model: work done by devices joining over time, case by case."""

from __future__ import annotations

import math

import pytest

from pivotrl.control.planner.fluid import fifo, left_at


def test_work_left_at_a_time_of_afifo():
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
