"""Held-out evaluation: greedy generation requests of the held-out problems with the weights of a step, scored by
the task's checker. Its requests share the rollout devices and queue; their uids say which evaluation and which
problem they are, so an answer needs no other bookkeeping."""

from __future__ import annotations

from collections.abc import Callable, KeysView

from pivotrl.control.messages import GenParams, GenRequest
from pivotrl.sample import Problem

EVAL_UID = 1 << 40  # evaluation requests live above this uid ...
EVAL_STRIDE = 1 << 24  # ... in one block per evaluation, so two evaluations in flight never mix


def is_eval(uid: int) -> bool:
    """Whether a generation request is a held-out problem's (else a training sample's)."""
    return uid >= EVAL_UID


class Evaluation:
    """The evaluations running (``running``: the steps whose weights they evaluate) and the accuracies so far
    (``accuracy``: step -> share of the held-out problems answered correctly after it)."""

    def __init__(
        self,
        heldout: list[Problem],
        params: GenParams,
        every: int,
        last_step: int,
        prompt: Callable[[str], str],
        check: Callable[[str, str], bool],
    ) -> None:
        self.heldout, self.params, self.every, self.last_step = heldout, params, every, last_step
        self.prompt, self.check = prompt, check
        self._hits: dict[int, dict[int, bool]] = {}  # step evaluated after -> held-out index -> correct
        self.accuracy: dict[int, float] = {}

    @property
    def running(self) -> KeysView[int]:
        """The steps whose evaluation is running."""
        return self._hits.keys()

    def due(self, step: int) -> bool:
        """Whether the weights after ``step`` are evaluated: every ``every`` steps (0: none) and after the last."""
        return step == self.last_step or (self.every > 0 and step % self.every == 0)

    def begin(self, after_step: int) -> list[GenRequest]:
        """The requests of the evaluation of the weights after ``after_step`` (0: the initial weights)."""
        if len(self.heldout) >= EVAL_STRIDE:
            raise ValueError(f"at most {EVAL_STRIDE - 1} held-out problems are evaluated, got {len(self.heldout)}")
        self._hits[after_step] = {}
        base = EVAL_UID + after_step * EVAL_STRIDE
        return [GenRequest(base + i, self.prompt(p.question), 0, self.params) for i, p in enumerate(self.heldout)]

    def request(self, uid: int) -> GenRequest:
        """A held-out request from the start (its device was lost)."""
        p = self.heldout[(uid - EVAL_UID) % EVAL_STRIDE]
        return GenRequest(uid, self.prompt(p.question), 0, self.params)

    def answered(self, uid: int, text: str) -> bool:
        """A held-out answer is in; True when it completes its evaluation (its accuracy is then known)."""
        after_step, index = divmod(uid - EVAL_UID, EVAL_STRIDE)
        hits = self._hits[after_step]
        hits[index] = self.check(text, self.heldout[index].reference)
        if len(hits) < len(self.heldout):
            return False
        self.accuracy[after_step] = sum(hits.values()) / len(self.heldout)
        del self._hits[after_step]
        return True
