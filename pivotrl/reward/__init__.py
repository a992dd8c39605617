"""Rewards from a generative judge (GenRM)."""

from pivotrl.reward.genrm import GenRM, JudgeStats, Judgment, Outcome

__all__ = ["GenRM", "JudgeStats", "Judgment", "Outcome"]
