"""The one interface through which a device drives generation, whatever the backend.

A device worker adds sequences (new, or resumed with their tokens so far),
runs the engine in time slices, takes sequences out when they must move, and
loads weight versions. Two backends implement it: the native
:class:`~pivotrl.engine.engine.Engine` (CPU, reference, token-identical
migration) and :class:`~pivotrl.engine.vllm_engine.VllmEngine` (vLLM, for GPU
clusters). The control plane never learns which one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pivotrl.engine.engine import EngineStats, SeqState
from pivotrl.gps import Snapshot

BACKENDS = ("native", "vllm")


@dataclass(slots=True)
class SliceReport:
    """What one time slice of generation did."""

    finished: list[SeqState] = field(default_factory=list)
    running: int = 0  # sequences held (waiting or running) when the slice began
    tokens: int = 0  # tokens sampled
    steps: int = 0  # engine steps that decoded only (prefill steps are timed apart)
    kv: int = 0  # context tokens the decode steps attended to
    prefill_tokens: int = 0  # prompt (and resumed) tokens computed
    prefill_s: float = 0.0  # seconds of the steps that prefilled
    progress: tuple[tuple[int, int], ...] = ()  # (uid, tokens so far) of the sequences still running


class GenerationEngine(Protocol):
    """What :class:`~pivotrl.runtime.worker.Worker` needs from a generation backend."""

    max_batch: int  # sequences it runs at once
    max_len: int  # longest prompt + response it holds
    stats: EngineStats

    def add(self, state: SeqState) -> None:
        """Queue a new sequence, or resume one taken out of any engine (its tokens so far are kept)."""

    def abort(self, uid: int) -> SeqState:
        """Take a sequence out; its state (tokens and log-probs so far) resumes anywhere."""

    def abort_all(self) -> list[SeqState]: ...

    @property
    def has_work(self) -> bool: ...

    @property
    def load(self) -> int:
        """Sequences held, waiting or running."""

    def run(self, seconds: float, clock: Callable[[], float]) -> SliceReport:
        """At least one engine step, then more until ``seconds`` of ``clock`` have passed."""

    def ensure_capacity(self, max_len: int) -> None:
        """Hold sequences of ``max_len`` tokens from now on (only while idle)."""

    def load_weights(self, snap: Snapshot) -> None:
        """Replace the weights in place with a GPS version of the same model; only while idle."""

    def sleep(self) -> None:
        """Free the device memory the engine holds (weights and KV cache); ``wake`` takes it back."""

    def wake(self) -> None: ...
