"""What a run of either driver reports, computed the same way for both.

The runtime (real devices) and the simulator (modeled devices on a virtual
clock) run the same control plane; these functions turn its state into the
loop's spec, the run's summary and its per-sample rows, so the two kinds of
run write files with the same keys. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pivotrl.config import JobConfig
from pivotrl.control.controller import Controller, LoopSpec, StepRecord
from pivotrl.control.messages import GenParams
from pivotrl.resolve import Plan
from pivotrl.task.checkers import get_checker
from pivotrl.task.rules import exact_match
from pivotrl.telemetry import Slice


def loop_spec(cfg: JobConfig, plan: Plan, chat: Callable[[str], str] | None = None, simulated: bool = False
              ) -> LoopSpec:  # fmt: skip
    """The loop's spec, for either driver: the job's settings, the plan's answers to its ``auto`` keys.
    ``chat``: the policy's chat template (a run reads it from the checkpoint). ``simulated``: no checkpoints, and
    the synthetic responses are judged correct by the exact checker, whatever ``task.checker`` says (no text is
    real there)."""
    r, j, e = cfg.rollout, cfg.judge, cfg.eval
    return LoopSpec(
        seed=cfg.seed,
        steps=cfg.steps,
        prompts_per_step=r.prompts_per_step,
        group_size=r.group_size,
        prompt_template=cfg.task.prompt_template,
        rollout=GenParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k),
        judge=GenParams(j.max_new_tokens, j.temperature),
        eval_params=GenParams(e.max_new_tokens, 0.0),
        eval_every=e.every,
        scale_by_std=cfg.train.scale_by_std,
        per_device=plan.rollout_per_device or r.max_batch,
        check=exact_match if simulated else get_checker(cfg.task.checker),
        judge_per_device=plan.judge_per_device,
        judge_kv=plan.judge_kv,
        rebalance=r.rebalance,
        sharded_train=plan.traits.unique_state,
        lockstep_train=plan.traits.lockstep,
        min_train_devices=plan.min_train_devices,
        checkpoint_every=0 if simulated else cfg.checkpoint.every,
        max_staleness=cfg.max_staleness,
        partial_rollout=cfg.partial_rollout,
        chat=chat,
    )


def sample_rows(records: list[StepRecord], token_ids: bool = True) -> Iterator[dict[str, Any]]:
    """One row per sample. ``token_ids=False`` writes the response's token count instead of its ids
    (the simulator's ids are placeholders, and millions of them would only fill the disk)."""
    for rec in records:
        for s in rec.samples:
            row: dict[str, Any] = {"step": rec.step, "uid": s.uid, "question": s.question}
            if token_ids:
                row["response_ids"] = s.response_ids
            else:
                row["response_tokens"] = len(s.response_ids)
            row.update(
                response=s.response_text,
                reward=s.reward,
                verdict=s.verdict,
                judge_tokens=s.judge_tokens,
                correct=s.correct,
                truncated=s.truncated,
                migrations=s.migrations,
                policy_version=s.policy_version,  # the version that generated it (the step's less its lag)
            )
            if s.token_versions:  # (partial rollouts: [first token, version] of each run of one version's tokens)
                row["token_versions"] = [list(x) for x in s.token_versions]
            yield row


def steady_rate(metrics: list[dict[str, Any]], per_step: int) -> float:
    """Samples per second after the first step (which pays the devices' first loads): of overlapping steps, from
    the first update to the last (their own times overlap)."""
    later = metrics[1:] or metrics
    ends = [m["at_s"]["end"] if "at_s" in m else None for m in metrics]
    if len(ends) > 1 and None not in ends and all(a < b for a, b in zip(ends, ends[1:], strict=False)):
        return per_step * len(later) / (ends[-1] - ends[0])  # (a resumed run's clock begins again: not this)
    seconds = sum(m["step_seconds"] for m in later)
    return per_step * len(later) / seconds if seconds > 0 else 0.0


GENERATING = ("rollout", "judge")  # the roles whose slices are generation (``Worker.run``)


def driver_wait(slices: list[Slice]) -> dict[str, float]:
    """The share of a generating device's time spent waiting for the driver: the gaps between one generation
    slice that left sequences in the engine and the next slice of the device, less what commands took in
    between (``commands_s``: adding work is the device's own), against those gaps plus the time it generated.
    Mean and max over the devices that generated (0 where none did)."""
    by_device: dict[int, list[Slice]] = {}
    for s in slices:
        by_device.setdefault(s.device, []).append(s)
    shares = []
    for own in by_device.values():
        own.sort(key=lambda s: s.start)
        generated = waited = 0.0
        for s, nxt in zip(own, [*own[1:], None], strict=True):
            if s.role not in GENERATING or "running" not in s.args:
                continue
            generated += s.end - s.start
            left = s.args["running"] - s.args.get("finished", 0)
            if nxt is not None and left > 0 and nxt.role == s.role:  # (less what commands took in between)
                waited += max(0.0, nxt.start - s.end - nxt.args.get("commands_s", 0.0))
        if generated:
            shares.append(waited / (waited + generated))
    return {"mean": sum(shares) / len(shares), "max": max(shares)} if shares else {"mean": 0.0, "max": 0.0}


def summarize(cfg: JobConfig, ctl: Controller, slices: list[Slice], wall: float) -> dict[str, Any]:
    # rates are of the steps this process ran (a resumed run's earlier steps ran in another)
    here = [m for m in ctl.metrics if m["step"] >= ctl.first_step]
    samples = len(here) * cfg.rollout.prompts_per_step * cfg.rollout.group_size
    tokens = sum(m["response_tokens"] + m["judge_tokens"] for m in here)
    agree = sum(m["judge_agreement"] for m in ctl.metrics) / len(ctl.metrics)
    busy: dict[str, float] = {}
    audit = {"checked": 0, "identical": 0, "dropped": 0}
    for s in slices:
        if s.role == "audit":  # the migration audit's counts, not time
            for k in audit:
                audit[k] += int(s.args.get(k, 0))
            continue
        busy[s.role] = busy.get(s.role, 0.0) + s.end - s.start
    capacity = max(wall, 1e-9) * cfg.devices
    shift_s = [e.seconds for e in ctl.shift_log]
    return {
        "mode": cfg.mode,
        "devices": cfg.devices,
        "split": cfg.split,
        "steps": cfg.steps,
        "samples": samples,
        "samples_per_s": samples / wall,
        "steady_samples_per_s": steady_rate(here, cfg.rollout.prompts_per_step * cfg.rollout.group_size),
        "tokens_per_s": tokens / wall,
        "accuracy_start": ctl.accuracy[0],
        "accuracy_end": ctl.accuracy[cfg.steps],
        "accuracy_gain": ctl.accuracy[cfg.steps] - ctl.accuracy[0],
        "judge_agreement": agree,
        "judge_parse_failures": sum(m["parse_failures"] for m in ctl.metrics),
        "role_busy_fraction": {r: t / capacity for r, t in sorted(busy.items())},
        "device_idle_fraction": max(0.0, 1.0 - sum(busy.values()) / capacity),
        "shifts": len(shift_s),
        "migrations": sum(m["migrations"] for m in ctl.metrics),
        "devices_lost": [{"seconds": round(t, 3), "device": d, "reason": why} for t, d, why in ctl.lost_log],
        # migrated sequences regenerated unmigrated beside them (rollout.audit_migrations): how many compared,
        # the share with identical tokens, and how many copies a shift stopped before they finished
        "migration_audit": audit
        | {"identical_share": audit["identical"] / audit["checked"] if audit["checked"] else None},
        # the share of a generating device's time spent waiting for the driver between two slices
        "driver_wait_share": driver_wait(slices),
        "shift_seconds": {"mean": sum(shift_s) / len(shift_s), "max": max(shift_s)}
        if shift_s
        else {"mean": 0, "max": 0},
        "wall_seconds": wall,
    }
