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
    """``fn(rank, *args)`` in ``nprocs`` spawned processes, waiting for every one to end (``mp.spawn`` would kill
    the others once one aborts, maybe before they marked their end). Fails if a rank exited otherwise than
    cleanly, unless it aborted after marking its end."""
    marks.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_marked, args=(fn, str(marks), *args), nprocs=nprocs, join=False, start_method="spawn")
    for process in ctx.processes:
        process.join()
    for rank, process in enumerate(ctx.processes):
        code = process.exitcode
        if code == 0 or (code == -signal.SIGABRT and (marks / f"rank{rank}.done").exists()):
            continue
        name = signal.Signals(-code).name if code < 0 else None
        how = f"terminated with signal {name}" if name else f"exited with code {code}"
        raise ProcessExitedException(
            f"process {rank} {how} (its traceback, if any, is in the output above)",
            error_index=rank, error_pid=process.pid, exit_code=code, signal_name=name,
        )  # fmt: skip
