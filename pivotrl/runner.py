"""The RL job on one device, colocated: every role runs here, phase after phase.

One step, and what waits for what:

    prompts(step) -> generate (policy v) -> judge -> advantages -> train -> policy v+1
                                      \\-> rule checker (measurement only)

* Rollout of step v uses policy weights of version v; the optimizer step that
  makes v+1 waits for every reward of step v (on-policy GRPO).
* A response is judged as soon as its rollout finishes; on one device the
  phases still run in series, the multi-device runtime overlaps them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pivotrl.config import JobConfig
from pivotrl.engine import Engine, SamplingParams, SeqState
from pivotrl.log import logger
from pivotrl.model import Decoder, Tokenizer, load_model, save_model
from pivotrl.reward import GenRM, JudgeStats
from pivotrl.sample import Sample, Status
from pivotrl.task.arithmetic import Problem, read_jsonl
from pivotrl.task.rules import exact_match
from pivotrl.telemetry import Recorder, RunWriter
from pivotrl.train.grpo import GRPOTrainer, group_advantages


def sequence_seed(job_seed: int, step: int, uid: int) -> int:
    """Sampling seed of one sequence: fixed by (job seed, step, sample), not by placement."""
    return ((job_seed * 1_000_003 + step) * 1_048_583 + uid) % (1 << 62)


@dataclass(slots=True)
class Roles:
    """Role contexts of the one local device."""

    policy: Decoder
    policy_tok: Tokenizer
    judge: Decoder
    judge_tok: Tokenizer
    rollout_engine: Engine
    judge_engine: Engine
    trainer: GRPOTrainer
    genrm: GenRM
    version: int = 0


@dataclass(slots=True)
class RunTotals:
    samples: int = 0
    response_tokens: int = 0
    judge_tokens: int = 0
    agree: int = 0
    judged: int = 0
    parse_failures: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)


def make_samples(cfg: JobConfig, problems: list[Problem], step: int, tok: Tokenizer) -> list[Sample]:
    rng = random.Random(cfg.seed * 7919 + step)
    chosen = rng.sample(problems, cfg.rollout.prompts_per_step)
    out = []
    for p_idx, prob in enumerate(chosen):
        ids = tok.encode(cfg.task.prompt_template.format(question=prob.question))
        for g in range(cfg.rollout.group_size):
            uid = p_idx * cfg.rollout.group_size + g
            out.append(Sample(uid, p_idx, prob.question, prob.reference, ids, sequence_seed(cfg.seed, step, uid)))
    return out


def generate(roles: Roles, samples: list[Sample], params: SamplingParams) -> None:
    """Rollout phase: every sample gets a response from the current policy."""
    states = [SeqState(s.uid, s.prompt_ids, s.seed, params) for s in samples]
    for s in samples:
        s.status, s.policy_version = Status.GENERATING, roles.version
    roles.rollout_engine.generate(states)
    for s, st in zip(samples, states, strict=True):
        s.response_ids, s.logprobs = st.output_ids, st.logprobs
        s.truncated = st.finish_reason == "length"
        s.status = Status.TRUNCATED if s.truncated else Status.FINISHED
        s.response_text = roles.policy_tok.decode(st.output_ids)


def judge(roles: Roles, samples: list[Sample], params: SamplingParams, stats: JudgeStats) -> int:
    """Judge phase: the GenRM writes a judgment per response; rewards parsed from it."""
    states = []
    for s in samples:
        prompt = roles.judge_tok.encode(roles.genrm.prompt(s.question, s.reference, s.response_text))
        states.append(SeqState(s.uid, prompt, s.seed, params))
    roles.judge_engine.ensure_capacity(max(len(st.prompt_ids) for st in states) + params.max_new_tokens)
    roles.judge_engine.generate(states)
    for s, st in zip(samples, states, strict=True):
        s.judge_text = roles.judge_tok.decode(st.output_ids)
        result = roles.genrm.score(s.judge_text, truncated=st.finish_reason == "length")
        stats.add(result)
        s.reward, s.verdict, s.status = result.reward, result.label, Status.JUDGED
        s.correct = exact_match(s.response_text, s.reference)
    return sum(len(st.output_ids) for st in states)


def evaluate(roles: Roles, cfg: JobConfig, problems: list[Problem]) -> float:
    """Held-out accuracy: greedy decoding, rule checker."""
    params = SamplingParams(cfg.eval.max_new_tokens, 0.0, stop_token_ids=tuple(roles.policy_tok.eos_token_ids))
    states = [
        SeqState(i, roles.policy_tok.encode(cfg.task.prompt_template.format(question=p.question)), 0, params)
        for i, p in enumerate(problems)
    ]
    roles.rollout_engine.generate(states)
    decode = roles.policy_tok.decode
    hits = sum(exact_match(decode(st.output_ids), p.reference) for st, p in zip(states, problems, strict=True))
    return hits / len(problems)


def setup(cfg: JobConfig) -> Roles:
    torch.manual_seed(cfg.seed)
    policy, policy_tok = load_model(cfg.policy.path, cfg.policy.dtype)
    judge_model, judge_tok = load_model(cfg.judge.path, cfg.judge.dtype)
    for p in judge_model.parameters():
        p.requires_grad_(False)
    ref = None
    if cfg.train.kl_coef > 0:
        ref, _ = load_model(cfg.policy.path, cfg.policy.dtype)
        for p in ref.parameters():
            p.requires_grad_(False)
    r = cfg.rollout
    return Roles(
        policy=policy,
        policy_tok=policy_tok,
        judge=judge_model,
        judge_tok=judge_tok,
        rollout_engine=Engine(policy, r.max_batch, max_len=256),
        judge_engine=Engine(judge_model, r.max_batch, max_len=256),
        trainer=GRPOTrainer(policy, cfg.train, temperature=r.temperature, ref_model=ref),
        genrm=GenRM(cfg.judge.template, cfg.judge.verdict_pattern, cfg.judge.rewards, cfg.judge.fallback_reward),
    )


def run_job(cfg: JobConfig, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """Run the whole job; writes metrics.jsonl, summary.json and the final policy under ``out``."""
    from tqdm import tqdm

    writer = RunWriter(out)
    writer.write_json("config.json", cfg.to_dict())
    train_set, heldout = read_jsonl(cfg.task.train_file), read_jsonl(cfg.task.heldout_file)[: cfg.eval.size]
    if cfg.rollout.prompts_per_step > len(train_set):
        raise ValueError(
            f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) exceeds the {len(train_set)} train problems"
        )
    roles = setup(cfg)
    r = cfg.rollout
    stop = tuple(roles.policy_tok.eos_token_ids)
    rollout_params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, stop)
    judge_params = SamplingParams(
        cfg.judge.max_new_tokens, cfg.judge.temperature, stop_token_ids=tuple(roles.judge_tok.eos_token_ids)
    )
    totals = RunTotals()
    top = max(cfg.judge.rewards.values())
    recorder = Recorder()
    with PhaseTimer(recorder, 0)("eval"):
        acc_start = acc = evaluate(roles, cfg, heldout)
    logger.info("held-out accuracy at start: %.3f", acc_start)
    bar = tqdm(range(1, cfg.steps + 1), desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    train_wall = 0.0
    for step in bar:
        timer = PhaseTimer(recorder, step)
        step_t0 = time.perf_counter()
        samples = make_samples(cfg, train_set, step, roles.policy_tok)
        with timer("rollout"):
            generate(roles, samples, rollout_params)
        stats = JudgeStats()
        with timer("judge"):
            judge_tokens = judge(roles, samples, judge_params, stats)
        with timer("train"):
            adv = group_advantages([s.reward for s in samples], r.group_size, cfg.train.scale_by_std)
            train_stats = roles.trainer.train_batch(samples, adv)
            roles.version += 1
        train_wall += time.perf_counter() - step_t0
        metrics = step_metrics(step, samples, stats, judge_tokens, timer.seconds, train_stats, top)
        if cfg.eval.every and step % cfg.eval.every == 0 or step == cfg.steps:
            with timer("eval"):
                acc = evaluate(roles, cfg, heldout)
            metrics["heldout_accuracy"] = acc
        metrics["time_s"] = timer.seconds
        writer.step(metrics)
        totals.samples += len(samples)
        totals.response_tokens += sum(len(s.response_ids) for s in samples)
        totals.judge_tokens += judge_tokens
        totals.judged += len(samples)
        totals.agree += sum(judge_says_correct(s, top) == bool(s.correct) for s in samples)
        totals.parse_failures += stats.parse_failures
        for k, v in timer.seconds.items():
            totals.phase_s[k] = totals.phase_s.get(k, 0.0) + v
        bar.set_postfix(
            reward=f"{metrics['reward_mean']:.2f}", acc=f"{acc:.2f}", tok_s=f"{metrics['tokens_per_s']:.0f}"
        )
    save_model(roles.policy, roles.policy_tok, Path(out) / "policy")
    summary = {
        "mode": cfg.mode,
        "devices": cfg.devices,
        "steps": cfg.steps,
        "samples": totals.samples,
        "samples_per_s": totals.samples / train_wall,
        "tokens_per_s": (totals.response_tokens + totals.judge_tokens) / train_wall,
        "accuracy_start": acc_start,
        "accuracy_end": acc,
        "accuracy_gain": acc - acc_start,
        "genrm_agreement": totals.agree / max(1, totals.judged),
        "genrm_parse_failures": totals.parse_failures,
        "phase_seconds": totals.phase_s,
        "wall_seconds": recorder.now(),
        "role_busy_fraction": role_busy_fraction(recorder, devices=1),
        "device_idle_fraction": 1.0 - sum(role_busy_fraction(recorder, devices=1).values()),
        "shifts": 0,
        "policy_checkpoint": str(Path(out) / "policy"),
    }
    writer.write_json("summary.json", summary)
    writer.write_events(recorder.slices, title=f"{cfg.mode}, {cfg.devices} device(s), {cfg.steps} steps")
    return summary


def role_busy_fraction(recorder: Recorder, devices: int) -> dict[str, float]:
    """Share of all device-seconds of the run that each role kept busy."""
    total = recorder.now() * devices
    busy: dict[str, float] = {}
    for s in recorder.slices:
        busy[s.role] = busy.get(s.role, 0.0) + s.end - s.start
    return {role: sec / total for role, sec in busy.items()} if total > 0 else {}


def judge_says_correct(sample: Sample, top_reward: float) -> bool:
    """The judge's verdict read as right/wrong: it gave the best reward it can give."""
    return sample.reward >= top_reward


def step_metrics(
    step: int,
    samples: list[Sample],
    stats: JudgeStats,
    judge_tokens: int,
    phase_s: dict[str, float],
    train: dict,
    top: float,
) -> dict[str, Any]:
    n = len(samples)
    rewards = [s.reward for s in samples]
    resp_tokens = sum(len(s.response_ids) for s in samples)
    busy = sum(phase_s.values())
    return {
        "step": step,
        "reward_mean": sum(rewards) / n,
        "accuracy": sum(bool(s.correct) for s in samples) / n,
        "judge_agreement": sum(judge_says_correct(s, top) == bool(s.correct) for s in samples) / n,
        "parse_failures": stats.parse_failures,
        "judge_outcomes": stats.by_outcome,
        "response_length": resp_tokens / n,
        "truncated": sum(s.truncated for s in samples),
        "tokens_per_s": (resp_tokens + judge_tokens) / busy if busy else 0.0,
        "samples_per_s": n / busy if busy else 0.0,
        **{f"train_{k}": v for k, v in train.items()},
    }


PHASE_ROLE = {"rollout": "rollout", "judge": "genrm", "train": "train", "eval": "eval"}


class PhaseTimer:
    """``with timer("rollout"): ...`` accumulates wall seconds per phase and
    records a slice of device 0's timeline for it."""

    def __init__(self, recorder: Recorder, step: int) -> None:
        self.seconds: dict[str, float] = {}
        self.recorder, self.step = recorder, step

    def __call__(self, name: str) -> _Phase:
        return _Phase(self, name)


class _Phase:
    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.t0 = self.timer.recorder.now()

    def __exit__(self, *exc: object) -> None:
        t1 = self.timer.recorder.now()
        self.timer.seconds[self.name] = self.timer.seconds.get(self.name, 0.0) + t1 - self.t0
        self.timer.recorder.add(0, PHASE_ROLE[self.name], f"{self.name} step {self.timer.step}", self.t0, t1)
