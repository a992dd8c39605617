import pytest

from pivotrl.control.metrics import quantiles


def test_quantiles_of_the_waits():
    assert quantiles([]) == {"median": 0.0, "p90": 0.0, "max": 0.0}
    assert quantiles([4.0]) == {"median": 4.0, "p90": 4.0, "max": 4.0}
    assert quantiles([3.0, 1.0, 2.0]) == pytest.approx({"median": 2.0, "p90": 2.8, "max": 3.0})
    assert quantiles([float(x) for x in range(11)]) == pytest.approx({"median": 5.0, "p90": 9.0, "max": 10.0})
