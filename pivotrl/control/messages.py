"""Commands the control plane sends to devices, and events devices send back.

Every message names the device it concerns. Requests carry text and token
ids, never tensors: a device turns them into model inputs with its own
tokenizer, so the control plane stays free of torch and of any one model.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class Role(enum.Enum):
    ROLLOUT = "rollout"
    JUDGE = "judge"
    TRAIN = "train"

    # members are singletons, equal only to themselves: identity hashing, in C, instead of Enum's
    # Python-level hash of the name (the planner hashes roles millions of times per simulated step)
    __hash__ = object.__hash__


ROLES = tuple(Role)


@dataclass(slots=True, frozen=True)
class GenParams:
    """Sampling settings of a request; the device adds its tokenizer's stop tokens."""

    max_new_tokens: int
    temperature: float = 1.0  # <= 0: greedy
    top_p: float = 1.0
    top_k: int = 0


@dataclass(slots=True)
class GenRequest:
    """Generate (or continue) one policy response. ``output_ids`` is non-empty when a
    migrated sequence resumes: the device re-prefills prompt + output and goes on."""

    uid: int
    prompt: str
    seed: int
    params: GenParams
    prompt_ids: list[int] = field(default_factory=list)  # filled by the first device that encodes the prompt
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # the version that wrote ``output_ids`` where it may differ from the one resuming them (a partial rollout); -1:
    # the same (what a migration between devices of one version resumes)
    prefix_version: int = -1


@dataclass(slots=True)
class GenResult:
    uid: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    version: int  # policy version that generated it


@dataclass(slots=True, frozen=True)
class JudgeRequest:
    uid: int
    question: str
    reference: str
    response: str
    seed: int
    params: GenParams
    prompt_ids: tuple[int, ...] = ()  # set when a migrated judgment resumes: the rendered, encoded prompt ...
    output_ids: tuple[int, ...] = ()  # ... and the judgment written so far
    # the GRPO group (prompt index) of the response, -1 for none: a group's judgments begin alike (the template,
    # the question, the reference before the response), so a judge device with a prefix cache that judged one
    # of them reads the rest's beginnings from its cache (the scheduler sends them to one device where the
    # balance allows)
    group: int = -1


@dataclass(slots=True, frozen=True)
class JudgeResult:
    uid: int
    text: str
    truncated: bool
    tokens: int


# -- commands -----------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Shift:
    """Release the device's current role context and load ``role`` at ``version``
    (policy version for rollout/train; ignored for the frozen judge)."""

    device: int
    role: Role
    version: int


@dataclass(slots=True, frozen=True)
class Generate:
    device: int
    requests: tuple[GenRequest, ...]
    version: int  # the policy version these requests must be served with


@dataclass(slots=True, frozen=True)
class Judge:
    device: int
    requests: tuple[JudgeRequest, ...]


@dataclass(slots=True, frozen=True)
class TrainShard:
    """One device's part of a data-parallel update: judged samples, each with its group's advantage.
    The token lists are the samples' own (read-only), not copies: a step's are 10^7 tokens."""

    prompt_ids: tuple[Sequence[int], ...]
    response_ids: tuple[Sequence[int], ...]
    logprobs: tuple[Sequence[float], ...]
    advantages: tuple[float, ...]


@dataclass(slots=True, frozen=True)
class Accumulate:
    """Forward/backward of some judged GRPO groups on a train device: gradients of
    the token-sum loss add up in place; nothing changes the weights yet. Groups
    arrive as soon as they are judged, while the rollout tail still runs."""

    device: int
    version: int  # the policy version the groups were generated with
    shard: TrainShard


@dataclass(slots=True, frozen=True)
class Step:
    """The optimizer step of policy ``version`` -> ``version + 1`` over ``devices``:
    gradients are summed across them and divided by ``total_tokens``, the
    response-token count of the whole batch, so the update does not depend on
    how groups were spread or in which order they came."""

    devices: tuple[int, ...]
    version: int
    total_tokens: int
    # a checkpoint follows this step: the trainer leaves its whole state of ``version + 1`` in the GPS (a sharded
    # one writes its shards as ``<policy>.checkpoint``) before it reports ``Trained``
    checkpoint: bool = False


@dataclass(slots=True, frozen=True)
class Abort:
    """Stop requests in flight on ``device`` and hand their state back (migration): those of
    ``uids`` (the ones still in flight; a request that finished meanwhile is reported as
    finished), or every one when ``uids`` is empty."""

    device: int
    uids: tuple[int, ...] = ()


Command = Shift | Generate | Judge | Accumulate | Step | Abort


# -- events -------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ShiftDone:
    device: int
    role: Role
    version: int
    seconds: float
    nbytes: int  # bytes loaded into the device


@dataclass(slots=True, frozen=True)
class Generated:
    """Sequences that finished on a device (streamed: a few at a time)."""

    device: int
    results: tuple[GenResult, ...]


@dataclass(slots=True, frozen=True)
class Judged:
    device: int
    results: tuple[JudgeResult, ...]


@dataclass(slots=True, frozen=True)
class Progress:
    """What one generation slice of a device did: the planner's live measurements."""

    device: int
    role: Role
    seconds: float
    tokens: int  # tokens sampled in the slice
    running: int  # sequences in the engine when the slice started
    tokens_so_far: tuple[tuple[int, int], ...] = ()  # (uid, tokens written) of sequences running (prefilled)
    prefill_tokens: int = 0  # prompt (and resumed) tokens prefilled in the slice ...
    prefill_seconds: float = 0.0  # ... and the time those prefill steps took
    steps: int = 0  # decode steps in the slice (0: not counted); tokens / steps is the mean batch
    kv_tokens: int = 0  # context tokens its decode steps attended to, summed over steps and sequences
    # (0: not counted); kv_tokens / tokens is the mean context


@dataclass(slots=True, frozen=True)
class Accumulated:
    device: int
    samples: int
    tokens: int  # through the forward and backward: prompts and responses, the units the planner prices
    seconds: float


@dataclass(slots=True, frozen=True)
class Trained:
    """The optimizer step is done and policy ``version`` is published to the GPS."""

    devices: tuple[int, ...]
    version: int  # the new version
    stats: dict[str, float]
    seconds: float
    # a trainer that backpropagates at the step (sharded: in lockstep) reports that work here instead of in
    # Accumulated events: tokens through forward and backward on all devices, and the seconds it took
    backward_tokens: int = 0
    backward_seconds: float = 0.0


@dataclass(slots=True, frozen=True)
class Aborted:
    """What a device was working on when aborted: generation requests carry the
    tokens generated so far (resumed elsewhere with the same seed, they go on
    exactly as they would have); judge requests start over."""

    device: int
    gen: tuple[GenRequest, ...]
    judge: tuple[JudgeRequest, ...]
    seconds: float


@dataclass(slots=True, frozen=True)
class DeviceLost:
    """A device died or missed its deadline (``device_timeout``): whatever it held is gone. Its sequences are
    generated again elsewhere from their seeds (the same tokens), its judgments redone, the samples it had
    backpropagated backpropagated again on the other train devices."""

    device: int
    reason: str


@dataclass(slots=True, frozen=True)
class StepFailed:
    """The optimizer step of ``version`` did not happen (a device of it was lost): the devices still there
    hold no usable train state; the step is done again from version ``version`` in the GPS."""

    devices: tuple[int, ...]  # the step's devices still there
    version: int
    reason: str


@dataclass(slots=True, frozen=True)
class DeviceJoined:
    """A device lost earlier is back (restarted), holding no role."""

    device: int


Event = (
    ShiftDone | Generated | Judged | Progress | Accumulated | Trained | Aborted | DeviceLost | DeviceJoined | StepFailed
)
