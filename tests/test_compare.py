import json
from pathlib import Path

import pytest

from pivotrl.cli import main
from pivotrl.compare import compare_runs


def write_run(path: Path, tokens: dict[tuple[int, int], list[int]], acc: dict[int, float]) -> Path:
    path.mkdir()
    rows = [{"step": s, "uid": u, "response_ids": t, "reward": float(sum(t) % 2)} for (s, u), t in tokens.items()]
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = [{"step": s, **({"heldout_accuracy": acc[s]} if s in acc else {})} for s in (1, 2, 3)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (path / "summary.json").write_text(json.dumps({"accuracy_start": acc[0]}))
    return path


BASE = {(s, u): [s, u, 7] for s in (1, 2, 3) for u in range(4)}


def test_identical_runs(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", BASE, {0: 0.5, 2: 0.6})
    b = write_run(tmp_path / "b", BASE, {0: 0.5, 2: 0.6})
    c = compare_runs(a, b)
    assert (c.samples, c.token_match, c.reward_match, c.first_difference) == (12, 1.0, 1.0, None)
    assert c.accuracy == [(0, 0.5, 0.5), (2, 0.6, 0.6)] and c.max_accuracy_gap == 0.0


def test_differences_are_counted_and_located(tmp_path: Path) -> None:
    other = dict(BASE)
    other[(2, 3)] = [2, 3, 8]  # one sequence differs at step 2 (and its reward with it)
    del other[(3, 0)]
    a = write_run(tmp_path / "a", BASE, {0: 0.5, 2: 0.6})
    b = write_run(tmp_path / "b", other, {0: 0.5, 2: 0.625})
    c = compare_runs(a, b)
    assert (c.samples, c.same_tokens, c.same_reward, c.only_in_one) == (11, 10, 10, 1)
    assert c.first_difference == 2 and c.differing == [(2, 3)]
    assert c.max_accuracy_gap == pytest.approx(0.025)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_run(tmp_path / "a", BASE, {0: 0.5, 2: 0.6})
    assert main(["compare", str(a), str(a)]) == 0
    assert "12/12 with identical tokens (100.00%)" in capsys.readouterr().out
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "samples.jsonl: not found" in err and "Traceback" not in err


def test_a_simulated_run_is_not_compared_with_a_real_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A simulated sample has a token count where a real one has tokens: "0/12 with identical tokens" said
    nothing; the two kinds are refused, two simulated runs still compare."""
    real = write_run(tmp_path / "real", BASE, {0: 0.5})
    sims = []
    for name in ("sim", "sim2"):
        sim = write_run(tmp_path / name, BASE, {0: 0.5})
        rows = [json.loads(x) for x in (sim / "samples.jsonl").read_text().splitlines()]
        rows = [{**{k: v for k, v in r.items() if k != "response_ids"}, "response_tokens": 3} for r in rows]
        (sim / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (sim / "summary.json").write_text(json.dumps({"accuracy_start": 0.5, "sim": {}, "sim_seconds": 1.0}))
        sims.append(sim)
    for a, b in ((sims[0], real), (real, sims[0])):
        assert main(["compare", str(a), str(b)]) == 2
        err = capsys.readouterr().err
        assert f"{sims[0]} is a simulated run (`pivotrl simulate`) and {real} a run of `pivotrl train`" in err
        assert "Traceback" not in err
    assert compare_runs(*sims).token_match == 1.0
