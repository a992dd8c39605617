"""Generation engine (continuous batching, counter-based sampling, abort/resume)."""

from pivotrl.engine.engine import Engine, EngineStats, SamplingParams, SeqState
from pivotrl.engine.sampling import sample

__all__ = ["Engine", "EngineStats", "SamplingParams", "SeqState", "sample"]
