"""Ranks of a process group in spawned processes, for tests.

gloo's teardown sometimes aborts a process at exit, after its group was
destroyed ("terminate called without an active exception": a store thread
still joinable when the process ends); about one run in five of a spawned
sharded job showed it. A rank that aborts there has done all its work, and
written everything the test reads. ``spawn`` tells that apart from a rank
that failed: each rank marks its end once its function has returned, and an
abort after every rank marked its end is not a failure.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing import ProcessExitedException


def _marked(rank: int, fn: Callable[..., None], marks: str, *args: Any) -> None:
    fn(rank, *args)
    (Path(marks) / f"rank{rank}.done").touch()


def spawn(fn: Callable[..., None], args: tuple, nprocs: int, marks: Path) -> None:
    """``mp.spawn(fn, args, nprocs)``, where a rank aborted at exit after ``fn`` returned on every rank passes."""
    marks.mkdir(parents=True, exist_ok=True)
    try:
        mp.spawn(_marked, args=(fn, str(marks), *args), nprocs=nprocs, join=True)
    except ProcessExitedException as e:
        done = all((marks / f"rank{r}.done").exists() for r in range(nprocs))
        if not (done and e.signal_name == signal.Signals.SIGABRT.name):
            raise
