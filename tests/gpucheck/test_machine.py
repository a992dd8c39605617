"""``pivotrl.gpucheck.machine``: a driver that lists GPUs torch does not see is a failed check, told apart from
a machine without GPUs, with a fake ``nvidia-smi`` on PATH."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pivotrl.gpucheck.machine import listed_gpus, unseen_gpus

H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"


def fake_nvidia_smi(where: Path, stdout: str, rc: int = 0) -> None:
    exe = where / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\ncat <<'OUT'\n{stdout}\nOUT\nexit {rc}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH whose only nvidia-smi is the fake one written in it (none until a test writes it)."""
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return tmp_path


def test_gpus_the_driver_lists_and_torch_does_not_see_fail_in_one_line(path: Path, monkeypatch) -> None:
    fake_nvidia_smi(path, H100)
    assert listed_gpus() == [H100]
    line = unseen_gpus(False, "2.13.0, a CPU-only build")
    assert line == (
        f"gpu-check: nvidia-smi lists 1 GPU(s) ({H100}) but torch (2.13.0, a CPU-only build) sees no CUDA device: "
        "install a CUDA build of torch the driver supports, or correct CUDA_VISIBLE_DEVICES"
    )
    assert unseen_gpus(True, "x") is None  # (torch sees them: nothing amiss)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # a GPU that is not there
    assert "sees no CUDA device with CUDA_VISIBLE_DEVICES='7':" in (unseen_gpus(False, "x") or "")
    for hidden in ("", "-1"):  # hidden on purpose: a CPU-only run
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert unseen_gpus(False, "x") is None


def test_no_driver_or_a_failing_one_lists_nothing(path: Path) -> None:
    assert listed_gpus() == [] and unseen_gpus(False, "x") is None  # (not on PATH)
    fake_nvidia_smi(path, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", rc=9)
    assert listed_gpus() == [] and unseen_gpus(False, "x") is None
    fake_nvidia_smi(path, "No devices were found")
    assert listed_gpus() == []
