"""What a killed driver's Ray instance leaves behind is removed at the next start, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pivotrl.runtime.ray_session import MARKER, clean_stale_sessions


def holder(path) -> subprocess.Popen:
    """A process keeping a file of ``path`` open, as Ray's agents keep their logs."""
    code = f"f = open({str(path / 'agent.log')!r}, 'a'); import time; time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    for _ in range(100):
        if (path / "agent.log").exists():
            break
        time.sleep(0.05)
    time.sleep(0.2)
    return proc


def test_only_sessions_of_dead_pivotrl_drivers_are_removed(tmp_path):
    dead_driver = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_driver.wait()
    stale, live, foreign = (tmp_path / f"session_{n}" for n in ("stale", "live", "foreign"))
    for s in (stale, live, foreign):
        s.mkdir()
    (stale / MARKER).write_text(str(dead_driver.pid))
    (live / MARKER).write_text(str(os.getpid()))  # a driver still running
    # foreign: no marker (a cluster somebody started with `ray start`)
    procs = {s: holder(s) for s in (stale, live, foreign)}
    try:
        assert clean_stale_sessions(tmp_path) == 1
        assert procs[stale].wait(timeout=10) == -9
        assert not stale.exists() and live.exists() and foreign.exists()
        assert procs[live].poll() is None and procs[foreign].poll() is None
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_driver_that_shut_its_ray_down_leaves_nothing_to_clean(tmp_path, monkeypatch, caplog):
    """A clean run's session is not taken for one a dead driver left: the next start says nothing."""
    import logging

    import ray

    from pivotrl.runtime.ray_driver import RayDriver
    from pivotrl.runtime.ray_session import mark_session

    session = tmp_path / "session_done"
    session.mkdir()
    mark_session(str(session))
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    (session / MARKER).write_text(str(exited.pid))  # as the next start finds it: the driver has exited since
    driver = object.__new__(RayDriver)  # as it stands once its devices are gone: only its own Ray is left
    driver.actors, driver.store, driver.pg, driver.started_ray, driver.session_dir = [], None, None, True, str(session)
    driver.pending, driver.lost = {}, set()
    shut = []
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [])
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))
    driver.close()
    assert shut and not (session / MARKER).exists()
    with caplog.at_level(logging.WARNING):
        assert clean_stale_sessions(tmp_path) == 0
    assert "removed a Ray instance" not in caplog.text and session.exists()
