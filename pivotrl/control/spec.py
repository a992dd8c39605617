"""What the step loop reads of the job (``LoopSpec``), how a sequence's sampling seed and a policy prompt are
made from it, and the error that ends an attempt at the run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pivotrl.control.messages import GenParams

# the uids of a step's requests: its slot among the steps in flight (step % (max_staleness + 1)) times this, plus
# the sample's index in the step (evaluation's uids begin far above: pivotrl.control.evaluation.EVAL_UID)
STEP_UID = 1 << 32
MAX_STALENESS = 64  # (slots of steps in flight stay below the evaluation's uids)


def sequence_seed(job_seed: int, step: int, uid: int) -> int:
    """Sampling seed of one sequence: fixed by (job seed, step, sample), not by placement."""
    return ((job_seed * 1_000_003 + step) * 1_048_583 + uid) % (1 << 62)


@dataclass(slots=True, frozen=True)
class LoopSpec:
    """The parts of the job config the loop needs: plain values, and two functions: the task's answer checker
    (``check``, task.checker; its libraries stay out of the control plane) and the policy's chat template
    (``chat``; the job reads it from the checkpoint, so the loop needs no template engine)."""

    seed: int
    steps: int
    prompts_per_step: int
    group_size: int
    prompt_template: str
    rollout: GenParams
    judge: GenParams
    eval_params: GenParams
    eval_every: int
    scale_by_std: bool
    per_device: int  # requests in flight per device
    # the task's answer checker (response text, reference) -> correct: measures accuracy, never rewards
    check: Callable[[str, str], bool]
    judge_per_device: int = 0  # judgments in flight per device (0: per_device)
    judge_kv: int = 0  # tokens of paged KV cache a judge device holds: its judgments' reads at most (0: no limit)
    rebalance: bool = True  # even out the sequences in flight over the rollout devices once none is queued
    sharded_train: bool = False  # the trainer shards its state over the train devices (one lost loses the state)
    # the trainer backpropagates every group at the optimizer step, in lockstep over its devices (FSDP2): a group
    # handed to a train device before is only buffered there, and no backward overlaps the rollout or the judge
    lockstep_train: bool = False
    # the fewest train devices the optimizer step runs on (train.min_devices): where one cannot hold the
    # trainer's state, the step waits for as many as hold it (at most every device not lost)
    min_train_devices: int = 1
    checkpoint_every: int = 0  # a checkpoint after every this many steps (0: none); see ``Controller.checkpoint``
    # the most policy versions a sample may lag behind the version its step trains (max_staleness): step s's rollout
    # may begin once version s - 1 - max_staleness is out, up to max_staleness + 1 steps in flight; 0: on-policy
    max_staleness: int = 0
    # a sequence on a rollout device an update left behind goes on with the newer weights (partial_rollout)
    partial_rollout: bool = False
    # the policy's chat template (task.chat_template) as a function of the formatted prompt; None: none
    chat: Callable[[str], str] | None = None

    def prompt(self, question: str) -> str:
        """What the policy reads for a question: the task's prompt, in its chat template when it has one."""
        prompt = self.prompt_template.format(question=question)
        return self.chat(prompt) if self.chat is not None else prompt


class DeviceLostError(RuntimeError):
    """A device was lost holding state nothing else holds (its shard of a sharded train state), or the optimizer
    step failed ``UPDATE_ATTEMPTS`` times in a row: this attempt at the run cannot go on; the job resumes from its
    newest checkpoint."""
