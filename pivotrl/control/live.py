"""Live statistics of the run, in the terms the planner's workload is expressed in: running means of lengths and
times (priors until measured), the last step's judgment lengths, and what each running sequence has written."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

from pivotrl.control.messages import Event, Generated, Judged, Trained
from pivotrl.sample import Sample

SMOOTHING = 0.2  # weight of a new observation in a running mean


class LiveStats:
    """``means``: running means (``judge_tokens``, ``response_tokens``, ``prompt_tokens``, ``step_seconds``,
    ``judge_reread``); ``so_far``: uid -> tokens a running sequence has written (a response, or a verdict)."""

    def __init__(self, judge_max_new_tokens: int, rollout_max_new_tokens: int) -> None:
        self.means = {
            "judge_tokens": float(judge_max_new_tokens) / 2,
            "response_tokens": float(rollout_max_new_tokens) / 2,
            "prompt_tokens": 16.0,
            "step_seconds": 0.1,
            "judge_reread": 1.0,
        }
        self.so_far: dict[int, int] = {}
        # tokens and judgments seen until the first step is trained (None from then on)
        self._first_judgments: list[int] | None = [0, 0]
        # the last step's judgment lengths, sorted, and the sums of each suffix (what a running judgment
        # has still to write is judged by them: a judge that reasons writes lengths of a long tail)
        self._judgments: tuple[list[int], list[int]] = ([], [0])

    @property
    def judgments(self) -> list[int]:
        """The last step's judgment lengths, sorted."""
        return self._judgments[0]

    def restore(self, means: dict[str, float], judgments: Iterable[int]) -> None:
        """The statistics a checkpoint kept (``means``, ``judgments``): the resumed run plans as the uninterrupted
        one would."""
        self.means.update(means)
        self._set_judgments(int(x) for x in judgments)
        self._first_judgments = None

    def _set_judgments(self, lengths: Iterable[int]) -> None:
        ordered = sorted(lengths)
        self._judgments = (ordered, list(itertools.accumulate(reversed(ordered), initial=0))[::-1])

    def observe(self, event: Event) -> None:
        """Running means from an event (progress reports aside: ``progress``)."""
        m = self.means
        seen = self._first_judgments
        if isinstance(event, Judged) and event.results and seen is not None:
            # judgments too are averaged over whole steps once there is one (``step_trained``): a judge that
            # reasons writes judgments of very different lengths, and the long ones end last; a running mean
            # of the first step's judgments until then
            seen[0] += sum(r.tokens for r in event.results)
            seen[1] += len(event.results)
            m["judge_tokens"] = seen[0] / seen[1]
        elif isinstance(event, Generated) and event.results:
            # response lengths are averaged over whole steps (``step_trained``): the responses that finish
            # first are the short ones, and those that finish last the long ones
            prompt = sum(len(r.prompt_ids) for r in event.results) / len(event.results)
            m["prompt_tokens"] += SMOOTHING * (prompt - m["prompt_tokens"])
        elif isinstance(event, Trained):  # the update alone: a lockstep trainer's backward is priced as such
            m["step_seconds"] += SMOOTHING * (event.seconds - event.backward_seconds - m["step_seconds"])

    def progress(self, tokens_so_far: Iterable[tuple[int, int]]) -> None:
        """(uid, tokens written) of running sequences."""
        self.so_far.update(tokens_so_far)

    def ended(self, uid: int) -> None:
        """A sequence ended, moved or was lost: what it wrote is no longer running."""
        self.so_far.pop(uid, None)

    def step_trained(self, samples: list[Sample], judge_prefill_tokens: int) -> None:
        """A step's lengths, as means over the whole step, and what the judge read per token of the judged prompts
        and responses (its template, and the judgments a full paged cache preempted, read again)."""
        m = self.means
        m["response_tokens"] = sum(len(s.response_ids) for s in samples) / max(1, len(samples))
        m["judge_tokens"] = sum(s.judge_tokens for s in samples) / max(1, len(samples))
        self._set_judgments(s.judge_tokens for s in samples)
        reads = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        if reads and judge_prefill_tokens:
            m["judge_reread"] = judge_prefill_tokens / reads
        self._first_judgments = None

    def verdict_left(self, written: int) -> float:
        """Tokens a judgment that has written ``written`` is expected still to write: the mean over the
        last step's judgments longer than that (one at least), or the running mean less what it wrote."""
        lengths, suffix = self._judgments
        i = bisect.bisect_right(lengths, written)
        if i == len(lengths):  # no step yet, or longer than any judgment of the last
            return max(1.0, self.means["judge_tokens"] - written) if not lengths else 1.0
        return suffix[i] / (len(lengths) - i) - written
