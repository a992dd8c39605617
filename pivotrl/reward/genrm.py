"""Generative reward: judge prompt, verdict parsing and the verdict -> reward policy.

The judge is an LLM; its output is text. A verdict that does not parse, a
label with no configured reward, or a judgment cut off by the length limit
maps to the configured fallback reward and is counted - never an exception.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field


class Outcome(enum.Enum):
    PARSED = "parsed"
    UNPARSABLE = "unparsable"  # no verdict found in the judgment
    UNKNOWN_LABEL = "unknown_label"  # a verdict whose label has no reward
    TRUNCATED = "truncated"  # judgment hit the length limit before a verdict


@dataclass(slots=True, frozen=True)
class Judgment:
    reward: float
    outcome: Outcome
    label: str | None  # the parsed verdict label, if any


@dataclass(slots=True)
class JudgeStats:
    """Counts over a batch of judgments, for metrics."""

    total: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)
    by_label: dict[str, int] = field(default_factory=dict)

    def add(self, j: Judgment) -> None:
        self.total += 1
        self.by_outcome[j.outcome.value] = self.by_outcome.get(j.outcome.value, 0) + 1
        if j.label is not None:
            self.by_label[j.label] = self.by_label.get(j.label, 0) + 1

    @property
    def parse_failures(self) -> int:
        return self.total - self.by_outcome.get(Outcome.PARSED.value, 0)


def judge_prompt(
    template: str, question: str, reference: str, response: str, chat: Callable[[str], str] | None = None
) -> str:
    """The judge's prompt: ``template`` filled in, then rendered by ``chat``, the judge's chat template
    (``judge.chat_template``), when there is one."""
    prompt = template.format(question=question, reference=reference, response=response)
    return chat(prompt) if chat is not None else prompt


class GenRM:
    """Renders judge prompts and turns judge outputs into rewards."""

    def __init__(
        self,
        template: str,
        verdict_pattern: str,
        rewards: dict[str, float],
        fallback_reward: float,
        chat: Callable[[str], str] | None = None,
    ) -> None:
        self.template = template
        self.chat = chat
        self.pattern = re.compile(verdict_pattern)
        if self.pattern.groups != 1:
            raise ValueError(f"verdict pattern {verdict_pattern!r} must have exactly one capture group")
        self.rewards = dict(rewards)
        self.fallback = fallback_reward

    def prompt(self, question: str, reference: str, response: str) -> str:
        return judge_prompt(self.template, question, reference, response, self.chat)

    def score(self, judgment: str, truncated: bool = False) -> Judgment:
        """Reward for one judgment text. The last verdict in the text counts."""
        matches = self.pattern.findall(judgment)
        if not matches:
            outcome = Outcome.TRUNCATED if truncated else Outcome.UNPARSABLE
            return Judgment(self.fallback, outcome, None)
        label = matches[-1].strip()
        if label not in self.rewards:
            return Judgment(self.fallback, Outcome.UNKNOWN_LABEL, label)
        return Judgment(self.rewards[label], Outcome.PARSED, label)
