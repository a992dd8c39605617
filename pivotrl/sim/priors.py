"""The planner's priors for a job's own models on a modeled GPU, before anything runs: what ``pivotrl plan``
prices a step with where no run was profiled.

A simulated run gives its planner the same priors when it starts (``pivotrl.sim.run``: each engine measures its
decode steps at batches 1, 2, 4, ... and two contexts, a prefill and a training pass, on the datasheet roofline,
``RooflineCosts``); here they are made for the models ``policy.path`` and ``judge.path`` name, in the dtypes the job
resolves to, on instances of the plan's ``tensor_parallel`` GPUs. Shifts between roles and the optimizer step are
priced on the same roofline, so the planner's estimate is of those models on that GPU, not of the bundled job.

What is assumed where no run has measured it: every prompt (the judge's template and question included) has
``prompt`` tokens, responses and judgments half their generation limits (the planner's own prior means).
"""

from __future__ import annotations

from pivotrl.config import JobConfig
from pivotrl.control.messages import ROLES, Role
from pivotrl.control.profiles import Profiles
from pivotrl.sim.costs import RooflineCosts
from pivotrl.sim.driver import SimSpec
from pivotrl.sim.hardware import GPU
from pivotrl.sim.models import ModelSpec
from pivotrl.sim.run import _startup_profile  # (the simulator's own start-up priors, made the same way)
from pivotrl.sim.workload import LengthDist, decode_context


def roofline_priors(
    cfg: JobConfig,
    profiles: Profiles,
    gpu: GPU,
    models: tuple[ModelSpec, ModelSpec],
    tp: int,
    *,
    prompt: int,
    contexts: tuple[int, int],
    checkpointed: bool = False,
    paged: bool = True,
) -> RooflineCosts:
    """Set ``profiles``' roles and shift costs to those of ``models`` (the policy's, the judge's) on instances of
    ``tp`` ``gpu``s; the costs they come from (for the optimizer step). ``contexts``: the longest policy and judge
    sequences; ``checkpointed``: training recomputes each layer's forward (4 forward passes a token, not 3);
    ``paged``: the engines page their KV cache (vLLM)."""
    r, j = cfg.rollout, cfg.judge
    costs = RooflineCosts(gpu, train_forwards=4.0 if checkpointed else 3.0)
    policy, judge = models
    lengths = LengthDist.fixed(max(1, r.max_new_tokens // 2), r.max_new_tokens)
    judgments = LengthDist.fixed(max(1, j.max_new_tokens // 2), j.max_new_tokens)
    spec = SimSpec(
        devices=max(1, cfg.devices // tp),
        tp=tp,
        costs=costs,
        policy=policy,
        genrm=judge,
        lengths=lengths,
        seed=cfg.seed,
        prompt_len=prompt,
        max_batch=r.max_batch,
        rollout_context=contexts[0],
        judge_context=contexts[1],
        judge_template_len=0,  # (the prompt's tokens include the template's)
        judge_lengths=judgments,
        yes_probability=0.5,
        verdicts=("", ""),
        paged=paged,
        rollout_decode_context=decode_context(prompt, lengths, r.max_new_tokens),
        judge_decode_context=decode_context(prompt + lengths.quantile(0.5), judgments, j.max_new_tokens),
    )
    _startup_profile(profiles, spec)
    model = {Role.ROLLOUT: policy, Role.JUDGE: judge, Role.TRAIN: policy}
    for src in (None, *ROLES):
        for dst in ROLES:
            if src is not dst:
                profiles.costs.observe(src, dst, costs.shift(model[dst], src, dst, tp))
    return costs
