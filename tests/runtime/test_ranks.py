"""The spawn helper of the multi-process tests: an abort at exit after the work passes, one during it fails."""

from __future__ import annotations

import atexit
import os

import pytest
from torch.multiprocessing import ProcessExitedException

from tests.runtime.ranks import spawn


def _aborts_at_exit(rank: int) -> None:
    atexit.register(os.abort)  # as gloo's teardown does at times, once the work is done


def _aborts_during_the_work(rank: int) -> None:
    if rank == 1:
        os.abort()


def test_an_abort_at_exit_after_every_rank_is_done_passes(tmp_path):
    spawn(_aborts_at_exit, (), 2, tmp_path)


def test_an_abort_before_a_rank_is_done_fails(tmp_path):
    with pytest.raises(ProcessExitedException, match="SIGABRT"):
        spawn(_aborts_during_the_work, (), 2, tmp_path)
