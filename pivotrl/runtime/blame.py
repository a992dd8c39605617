"""Which members of an overdue optimizer step hold it up: a pure choice from what each member says of itself.

When an optimizer step passes ``device_timeout``, the member whose call was sent
first (rank 0) is rarely the stuck one: it waits in the first collective like
every healthy member. Each member says how far it got (``Worker.progress``:
-1 not started, 0 meeting its group, 1 + n having entered n collectives), asked
in a thread of its own beside the step call; the ones that got least far where
the others got further hold the others up. On GPU, where a host thread runs
ahead of its kernels, a rank whose kernel hangs may count as far as the others:
then none stands out and the first overdue member is the one lost.
"""

from __future__ import annotations

PROBE_S = 5.0  # how long a device may take to say how far it is in an overdue step: no answer, it is the stuck one


def told(progress: int | None) -> str:
    if progress is None:
        return f"did not say how far it is within {PROBE_S:g} s"
    if progress < 0:
        return "has not started its part (a call before it does not end)"
    return "is meeting its group" if progress == 0 else f"has entered {progress - 1} collective(s)"


def blame(late: int, progress: dict[int, int | None], timeout: float) -> list[tuple[int, str]]:
    """The members of an overdue optimizer step to declare lost, each with why, from how far each says it is
    (``Worker.progress``; None: no answer). The members that did not answer are stuck whole; otherwise those
    that got least far, where the others got further: they wait in a collective the laggards never entered.
    Where none stands out (all equally far), the one whose deadline passed first (``late``)."""
    silent = sorted(d for d, p in progress.items() if p is None)
    if silent:
        return [(d, f"its optimizer step was overdue (device_timeout={timeout:g} s) and it did not say how far it "
                    f"was within {PROBE_S:g} s") for d in silent]  # fmt: skip
    low = min(p for p in progress.values() if p is not None)
    behind = sorted(d for d, p in progress.items() if p == low)
    if len(behind) < len(progress):
        why = f"it {told(low)}, while the other members of the optimizer step waited for it past device_timeout"
        return [(d, f"{why}={timeout:g} s") for d in behind]
    return [(late, f"no answer within device_timeout={timeout:g} s")]
