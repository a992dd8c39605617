"""A section run guarded, and the sections an interpreter's packages cannot run named, not failed."""

from __future__ import annotations

from pivotrl.gpucheck.sections import NOT_RUN, cannot_run, run_section

SECTIONS = ("parity", "gps_load", "gps_load_ray", "shifts", "engine", "fsdp", "zero", "vllm", "sampling", "job")


def test_a_failing_section_is_recorded_and_one_that_cannot_run_is_not_run() -> None:
    def broken() -> dict:
        raise RuntimeError("out of memory")

    failed = run_section("x", broken)
    assert failed["status"] == "failed" and "RuntimeError: out of memory" in failed["error"]
    assert "broken" in failed["traceback"]
    assert run_section("n", lambda: (_ for _ in ()).throw(NotImplementedError("later")))["status"] == (NOT_RUN)
    assert run_section("y", lambda: {"pass": False})["status"] == "failed"  # a check that did not hold
    assert run_section("z", lambda: {"pass": True, "n": 1}) == {
        "status": "ok",
        "result": {"pass": True, "n": 1},
        "seconds": 0.0,
    }


def test_sections_whose_packages_are_missing_are_named_not_failed(monkeypatch) -> None:
    """A GPU machine's own python3 (``make gpu-check-system``) may hold a CUDA torch but no Ray or vLLM:
    the sections that need them are skipped with the reason, the others run."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert cannot_run("gps_load_ray") == "Ray is not installed (make install adds it)"
    assert all(cannot_run(n) is None for n in ("parity", "gps_load", "shifts", "engine", "fsdp", "job"))
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("ray", "orjson") else real(name, *a)
    )
    assert cannot_run("gps_load_ray") == "Ray and orjson are not installed (make install adds it)"
    assert cannot_run("shifts") == cannot_run("job") == "orjson is not installed (make install adds it)"
    assert all(cannot_run(n) is None for n in ("parity", "gps_load", "engine", "fsdp"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("matplotlib", "transformers")
                        else real(name, *a))  # fmt: skip
    assert cannot_run("job") == "matplotlib is not installed (make install adds it)"  # (the timeline)
    assert cannot_run("parity") == cannot_run("engine") == ("transformers is not installed (make install adds it)")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # every package there
    assert all(cannot_run(n) is None for n in SECTIONS if n not in ("vllm", "sampling"))


def test_the_sampling_section_needs_vllm_as_the_vllm_section_does(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert cannot_run("sampling") == cannot_run("vllm") == "vLLM is not installed (make install adds it)"
