"""pivotrl's counter-based draw inside vLLM: the state of its logits processor, on the host and the device.

vLLM's contract (``vllm/v1/sample/logits_processor/interface.py``: ``LogitsProcessor``, ``BatchUpdate``):
``update_state`` runs before every forward pass (``InputBatch.refresh_metadata``, ``gpu_input_batch.py``),
given a ``BatchUpdate`` only when the persistent batch changed: rows removed, added (with the request's
``SamplingParams`` and a live reference to its list of output tokens) and moved (one way, or swapped), to be
applied in that order. ``apply`` gets the step's float32 logits, one row per request of the batch
(``Sampler.apply_logits_processors``, before the greedy argmax pivotrl's requests ask for), and may change them
in place.

What the processor keeps for each row of the batch: on the host, the request (its uid, offset, live output
list) and a mirror of what the device holds; on the device, one int32 table - seed key, position, top-k,
temperature and top-p (float32 bits), whether the row is pivotrl's - written only in ``update_state``, from
page-locked memory without waiting, when rows change or a position is not the one the device moved on to.

``apply`` draws (:func:`pivotrl.engine.sampling.draw`) without reading the device, moves each row's position
on, sets every logit of a row to -inf but the drawn token's (0), so that vLLM's argmax returns it, and copies
the log-probs into a fresh page-locked buffer without waiting. The engine reads them after ``LLMEngine.step``
(:func:`handed_back`): vLLM has synchronised by then to return the sampled tokens (``gpu_model_runner.py``,
``_to_list``: an event recorded after the tokens' copy, on the stream that ran this copy before it).

A row's position is its sequence's offset plus its output so far. vLLM also samples a row whose prompt is
still being prefilled in chunks, and throws that token away (``discard_request_mask``): its output list does
not grow, so ``update_state`` finds the device one position ahead and sends the right one back.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pivotrl.engine.sampling import Rows, Scratch, draw, seed_key

_SEED, _POS, _TOP_K, _TEMP, _TOP_P, _OURS = range(6)  # the columns of the table


@dataclass(slots=True)
class Drawn:
    """One step's draws: row i, where ``ours[i]``, drew position ``positions[i]`` of sequence ``uids[i]``."""

    uids: np.ndarray
    positions: np.ndarray
    ours: np.ndarray
    logprobs: torch.Tensor  # on the host; holds its values once the step has synchronised

    def items(self) -> Iterator[tuple[tuple[int, int], float]]:
        """((uid, position), log-prob) of each of pivotrl's rows."""
        rows = zip(self.uids.tolist(), self.positions.tolist(), self.ours.tolist(), self.logprobs.tolist(), strict=True)
        return (((uid, pos), lp) for uid, pos, ours, lp in rows if ours)


_HANDED: dict[int, list[Drawn]] = {}  # channel -> draws its engine has not read yet


def handed_back(channel: int) -> list[Drawn]:
    """The draws made for engine ``channel`` since it last asked, oldest first (read after the step)."""
    return _HANDED.pop(channel, [])


class CounterDraws:
    """The processor's state and work (vLLM's ``LogitsProcessor`` methods; the class vLLM builds adds its
    base). ``key``: the ``SamplingParams.extra_args`` entry holding a request's draw - an object with
    ``channel, uid, seed, offset, temperature, top_k, top_p``; rows without one are left as they are."""

    def __init__(self, max_rows: int, device: torch.device, pin: bool, key: str) -> None:
        self.device, self.pin, self.key = device, pin, key
        self.table = torch.zeros((max_rows, 6), dtype=torch.int32, device=device)
        self.host = np.zeros((max_rows, 6), dtype=np.int32)  # what the table holds (or will, once sent)
        self.host_f = self.host.view(np.float32)
        self.uids = np.zeros(max_rows, dtype=np.int64)
        self.offsets = np.zeros(max_rows, dtype=np.int64)
        self.outputs: list[Sequence[int]] = [()] * max_rows  # live output lists (vLLM appends to them)
        self.channel: int | None = None
        self.size = 0
        self.rows: Rows | None = None  # the draw's view of the first ``rows_n`` rows
        self.rows_n = -1
        self.ours = (False, False)  # (any, every) of the first ``rows_n`` rows is pivotrl's
        self.scratch = Scratch() if device.type == "cpu" else None  # (device memory: torch's allocator caches it)

    # -- update_state ------------------------------------------------------------------------------------------
    def update_state(self, batch_update: Any) -> None:
        changed = batch_update is not None
        if batch_update is not None:
            for row in batch_update.removed:
                self._clear(row)
            for row, params, _prompt, output in batch_update.added:
                self._set(row, (params.extra_args or {}).get(self.key), output)
            for a, b, how in batch_update.moved:
                self._move(a, b, swap=how.name == "SWAP")
            self.size = batch_update.batch_size
        n = self.size
        want = self.offsets[:n] + np.fromiter(map(len, self.outputs[:n]), np.int64, n)
        if changed or (want != self.host[:n, _POS]).any():
            self.host[:n, _POS] = want
            src = torch.from_numpy(self.host[:n])
            if self.pin:
                src = src.pin_memory()  # a fresh buffer: torch keeps it until the copy is done
            self.table[:n].copy_(src, non_blocking=self.pin)
            self._view(n)

    def _set(self, row: int, d: Any, output: Sequence[int]) -> None:
        if d is None:
            self._clear(row)
            return
        if self.channel is None:
            self.channel = d.channel
        assert d.channel == self.channel, "one processor serves one engine"
        self.host[row] = (seed_key(d.seed), d.offset + len(output), d.top_k, 0, 0, 1)
        self.host_f[row, _TEMP], self.host_f[row, _TOP_P] = d.temperature, d.top_p
        self.uids[row], self.offsets[row], self.outputs[row] = d.uid, d.offset, output

    def _clear(self, row: int) -> None:
        self.host[row] = 0
        self.uids[row], self.offsets[row], self.outputs[row] = 0, 0, ()

    def _move(self, a: int, b: int, swap: bool) -> None:
        for arr in (self.host, self.uids, self.offsets):
            arr[[a, b]] = arr[[b, a]]
        self.outputs[a], self.outputs[b] = self.outputs[b], self.outputs[a]
        if not swap:  # one way: a is left empty
            self._clear(a)

    def _view(self, n: int) -> None:
        """The draw's view of the first ``n`` rows, and the flags the host reads from its mirror."""
        t, hf = self.table[:n], self.host_f[:n]
        ours = self.host[:n, _OURS] == 1
        self.rows = Rows.of(
            t[:, _SEED],
            t[:, _POS],
            t[:, _TEMP].view(torch.float32),
            t[:, _TOP_K],
            t[:, _TOP_P].view(torch.float32),
            hf[:, _TEMP].tolist(),
            self.host[:n, _TOP_K].tolist(),
            hf[:, _TOP_P].tolist(),
            pin=self.pin,
        )
        self.rows_n, self.ours = n, (bool(ours.any()), bool(ours.all()))

    # -- apply -------------------------------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        if n != self.rows_n:  # (the batch's rows are the logits' rows: only a vLLM that differed would get here)
            self._view(n)
        any_ours, all_ours = self.ours
        if not any_ours:
            return logits
        assert self.rows is not None and self.channel is not None
        tokens, logprobs = draw(logits, self.rows, self.scratch)
        host = torch.empty(n, dtype=torch.float32, pin_memory=self.pin)
        host.copy_(logprobs, non_blocking=self.pin)
        h = self.host[:n]
        _HANDED.setdefault(self.channel, []).append(
            Drawn(self.uids[:n].copy(), h[:, _POS].copy(), h[:, _OURS] == 1, host)
        )
        ours = self.table[:n, _OURS]
        self.table[:n, _POS] += ours  # the next position, on the device
        self.host[:n, _POS] += self.host[:n, _OURS]  # and in its mirror
        if all_ours:
            logits.fill_(float("-inf"))
            return logits.scatter_(1, tokens[:, None], 0.0)
        mine = (ours != 0)[:, None]
        kept = logits.gather(1, tokens[:, None])
        logits.masked_fill_(mine, float("-inf"))
        return logits.scatter_(1, tokens[:, None], torch.where(mine, 0.0, kept))
