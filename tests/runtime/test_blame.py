"""Which members of an overdue optimizer step the Ray driver declares lost: the ones holding the others up,
told apart by how far each says it is, not the first whose deadline passed."""

from __future__ import annotations

from pivotrl.runtime.blame import PROBE_S, blame


def test_a_member_whose_part_never_started_is_blamed_not_rank_zero():
    # rank 0's deadline passed first, but it waits in the first collective; device 5's call never started
    stuck = blame(late=2, progress={2: 1, 5: -1, 7: 1}, timeout=8)
    assert [d for d, _ in stuck] == [5]
    assert "has not started its part" in stuck[0][1] and "device_timeout=8 s" in stuck[0][1]


def test_the_members_that_got_least_far_are_blamed():
    stuck = blame(late=0, progress={0: 4, 1: 3, 2: 4, 3: 3}, timeout=30)
    assert [d for d, _ in stuck] == [1, 3]
    assert "has entered 2 collective(s)" in stuck[0][1]


def test_a_member_that_does_not_answer_is_blamed_first():
    stuck = blame(late=0, progress={0: 2, 1: None, 2: -1}, timeout=8)
    assert [d for d, _ in stuck] == [1]
    assert f"did not say how far it was within {PROBE_S:g} s" in stuck[0][1]


def test_where_none_stands_out_the_first_overdue_is_blamed():
    assert blame(late=3, progress={3: 2, 4: 2}, timeout=8) == [(3, "no answer within device_timeout=8 s")]
    assert blame(late=3, progress={3: 0}, timeout=8) == [(3, "no answer within device_timeout=8 s")]
