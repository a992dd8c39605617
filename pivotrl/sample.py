"""The one record that travels through the pipeline: a sample.

A sample is one response to one prompt. Its status moves

    PENDING -> FINISHED | TRUNCATED -> JUDGED

A generation interrupted by a role shift is not an error: its request goes
back to the queue with the tokens so far (the sample stays PENDING and its
``migrations`` count goes up) and another device resumes it. This module is pure Python: the control plane and the
simulator use it without torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class Problem:
    """A prompt's question and the reference answer the judge (and the answer checker) compare against."""

    question: str
    reference: str


class Status(enum.Enum):
    PENDING = "pending"  # queued or generating
    FINISHED = "finished"  # ended on a stop token
    TRUNCATED = "truncated"  # ended on the length limit
    JUDGED = "judged"


@dataclass(slots=True)
class Sample:
    """One response to one prompt, from rollout through judging to training."""

    uid: int  # unique within a step: prompt_index * group_size + member
    prompt_index: int  # index of the prompt in the step (the GRPO group)
    question: str
    reference: str
    prompt_ids: list[int]
    seed: int  # sampling seed of this sequence (counter-based sampling)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # rollout log-prob of each response token
    status: Status = Status.PENDING
    response_text: str = ""
    policy_version: int = 0  # the version that generated it (its first token, where several did: token_versions)
    # partial rollouts: (first token, version) of each run of tokens one version generated, where more than one did
    token_versions: list[tuple[int, int]] = field(default_factory=list)
    reward: float = 0.0
    judge_text: str = ""
    judge_tokens: int = 0  # tokens of the judgment
    verdict: str | None = None  # parsed verdict label; None when unparsable
    correct: bool | None = None  # rule-based checker, for measurement only
    truncated: bool = False  # the response hit the length limit
    migrations: int = 0
