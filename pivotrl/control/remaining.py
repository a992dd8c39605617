"""What is left of the step, in the planner's terms (``Workload``): read from the queues and the devices running
requests (the scheduler), the devices holding each role (the fleet), the step's book and the live statistics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pivotrl.control.book import StepBook
from pivotrl.control.evaluation import is_eval
from pivotrl.control.fleet import Fleet
from pivotrl.control.live import LiveStats
from pivotrl.control.messages import Role
from pivotrl.control.profiles import Workload
from pivotrl.control.scheduler import Scheduler
from pivotrl.control.spec import STEP_UID, LoopSpec
from pivotrl.sample import Sample


def remaining_work(
    spec: LoopSpec,
    scheduler: Scheduler,
    fleet: Fleet,
    books: list[StepBook],
    by_uid: Mapping[int, Sample],
    stats: LiveStats,
    train_needed: int,
) -> Workload:
    """The workload left of the steps in flight (``books``, oldest first; none: only evaluation runs; ``by_uid``
    their samples by request uid); the training is the oldest's, the rollout and the judging every step's.
    ``train_needed``: the train devices an optimizer step still to run waits for (0: none to run)."""
    s = scheduler
    rollout = fleet.holders(Role.ROLLOUT)  # (in device order, as a pass over the devices gives)
    running = [uid for d in rollout for uid in s.running(d)]
    gen_uids = [r.uid for r in s.gen_queue] + running
    judge_devs = fleet.holders(Role.JUDGE)
    judging = [uid for d in judge_devs for uid in s.running(d)]
    g = spec.group_size
    lockstep = spec.lockstep_train
    book = books[0] if books else None
    # a group of another step in flight is another group (a step's prompt indexes begin at 0)
    group_base = {b.base: b.base // STEP_UID * spec.prompts_per_step for b in books}
    m, so_far = stats.means, stats.so_far

    def reads(uids: Iterable[int]) -> int:
        return sum(len(by_uid[u].prompt_ids) + len(by_uid[u].response_ids) for u in uids if u in by_uid)

    # a judgment its device has started (it reported tokens written) has read its prompt there
    read_running = reads(uid for uid in judging if uid not in so_far)
    read = read_running + reads(r.uid for r in s.judge_queue)
    # the groups left are the ones with the longest responses (those end last): their tokens as known so
    # far, a response still generating at what it has written (the planner adds what it expects to come)
    prompt = m["prompt_tokens"]
    left = list(book.not_backpropagated(lockstep)) if book is not None else []
    train_tokens = sum(len(x.prompt_ids) + len(x.response_ids) if x.response_ids else prompt + so_far.get(x.uid, 0)
                       for x in left)  # fmt: skip
    per_group = train_tokens / len(left) * g if left else (prompt + m["response_tokens"]) * g
    return Workload(
        rollout_remaining=[so_far.get(uid, 0) for uid in gen_uids],
        rollout_groups=[
            by_uid[u].prompt_index + group_base[u - u % STEP_UID] if not is_eval(u) and u in by_uid else -1
            for u in gen_uids
        ],
        rollout_queued=len(s.gen_queue),
        # rebalanced, the running sequences spread over every rollout device (0: any may hold them)
        rollout_holders=0 if spec.rebalance else sum(1 for d in rollout if s.load(d)),
        judge_queued=len(s.judge_queue) + len(judging),
        judge_running=len(judging),
        judge_holders=sum(1 for d in judge_devs if s.load(d)),
        judge_future=sum(1 for uid in gen_uids if not is_eval(uid)),
        judge_tokens_mean=m["judge_tokens"],
        train_groups_left=book.groups_left(lockstep) if book is not None else 0,
        train_groups_ready=-(-len(book.queue) // g) if book is not None else 0,
        train_groups_judging=book.groups_judging() if book is not None else 0,
        train_tokens_per_group=per_group,
        train_group_size=g,
        step_seconds=m["step_seconds"],
        prompt_tokens_mean=m["prompt_tokens"],
        judge_read_tokens=read,
        judge_read_running=read_running,
        judge_left_running=sum(stats.verdict_left(so_far.get(uid, 0)) for uid in judging),
        judge_written=[so_far.get(uid, 0) for uid in judging],
        judge_reread=m["judge_reread"],
        lockstep_train=lockstep,
        train_devices_needed=train_needed,
    )
