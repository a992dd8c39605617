"""The example jobs load, and the math-instruct one runs: small generated instruct-style checkpoints (chat
templates in their tokenizer configs), its parquet data with mapped columns, the math checker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.runtime.job import run_job
from tests.runtime.test_job import chat_checkpoints  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name", sorted(str(p.relative_to(ROOT / "examples")) for p in (ROOT / "examples").rglob("*.yaml"))
)
def test_every_example_loads(name):
    path = ROOT / "examples" / name
    simulated = "\nsim:" in "\n" + path.read_text()  # (a simulated job: its devices are instances of sim.gpus)
    load_config(path, simulated=simulated)


def test_the_math_instruct_example_runs_with_chat_templates(chat_checkpoints, tmp_path):  # noqa: F811
    cfg = load_config(
        ROOT / "examples/math_instruct.yaml",
        [
            f"policy.path={chat_checkpoints['policy']}",
            f"judge.path={chat_checkpoints['judge']}",
            "task.chat_template.enabled=true",
            "task.chat_template.system=Answer with the sum.",
            "judge.chat_template.enabled=true",
            "mode=colocated", "devices=1", "steps=2", "rollout.prompts_per_step=4", "rollout.group_size=2",
            "rollout.max_new_tokens=8", "judge.max_new_tokens=8", "eval.size=8", "eval.max_new_tokens=8",
            "eval.every=1", "threads_per_device=1",
        ],
    )  # fmt: skip
    assert cfg.task.checker == "math" and cfg.task.train_file.endswith(".parquet")
    summary = run_job(cfg, tmp_path, progress=False)
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 * 2 and all(r["question"] for r in rows)
    assert (tmp_path / "policy" / "tokenizer_config.json").is_file()
