"""The Ray instances a pivotrl driver starts: marked as its own, and cleaned up after a driver that died."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pivotrl.log import logger

MARKER = "pivotrl-driver"  # in the session directory of a Ray instance a pivotrl driver started: its pid


def ray_temp_dir() -> Path:
    return Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"


def mark_session(session_dir: str) -> None:
    """Note in the session directory of the Ray instance this driver started that this process owns it."""
    (Path(session_dir) / MARKER).write_text(str(os.getpid()))


def unmark_session(session_dir: str) -> None:
    """The Ray instance this driver started was shut down: nothing of it is left for a later start to end."""
    (Path(session_dir) / MARKER).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_sessions(root: Path | None = None) -> int:
    """Remove what Ray instances started by pivotrl drivers that died (SIGKILL, a crash) left behind: the
    processes still writing into their session directories (Ray's agents outlive a killed driver) and the
    directories. Only sessions carrying this driver's marker are touched, never a cluster someone started.
    Returns the processes ended."""
    root = root or ray_temp_dir()
    killed = 0
    for session in sorted(root.glob("session_*")) if root.is_dir() else []:
        marker = session / MARKER
        try:
            owner = int(marker.read_text())
        except (OSError, ValueError):
            continue
        if _alive(owner):
            continue
        prefix = str(session.resolve())
        ended = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                fds = os.listdir(f"/proc/{entry}/fd")
                targets = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in fds]
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if prefix in cmdline or any(t.startswith(prefix) for t in targets):
                try:
                    os.kill(int(entry), 9)
                    ended.append(int(entry))
                except OSError:
                    pass
        shutil.rmtree(session, ignore_errors=True)
        killed += len(ended)
        logger.warning(
            "removed a Ray instance left by pivotrl driver %d, which died: %d process(es), %s", owner, len(ended),
            session.name,
        )  # fmt: skip
    return killed
