"""The vLLM logits processor's state, driven as vLLM's model runner drives it (rows added, moved, removed; output
lists growing, or not when vLLM throws a chunked prefill's token away), without building an engine: it draws what
the native engine's sampler draws at each sequence's position, leaves other rows alone, and never reads the
device or sends it anything while it applies."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pivotrl.engine.sampling import sample
from pivotrl.engine.vllm_engine import _KEY, _Draw
from pivotrl.engine.vllm_sampling import CounterDraws, handed_back

CPU = torch.device("cpu")
VOCAB = 97


class Move(Enum):  # (vLLM's MoveDirectionality, by name)
    UNIDIRECTIONAL = 1
    SWAP = 2


def update(size: int, removed=(), added=(), moved=()) -> SimpleNamespace:
    return SimpleNamespace(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def request(uid: int, seed: int, offset: int = 0, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
            channel: int = 7) -> tuple[SimpleNamespace, list[int]]:  # fmt: skip
    """(vLLM's SamplingParams as the processor reads them, the request's live output list)."""
    draw = _Draw(channel, uid, seed, offset, temperature, top_k, top_p)
    return SimpleNamespace(extra_args={_KEY: draw}), []


def logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def native(x: torch.Tensor, draws: list[_Draw], positions: list[int]) -> tuple[list[int], list[float]]:
    """The native engine's draw of the same rows (its sampler, on the same logits)."""
    cols = [[d.seed for d in draws], positions, [d.temperature for d in draws], [d.top_k for d in draws],
            [d.top_p for d in draws]]  # fmt: skip
    tokens, logprobs = sample(x, *(torch.tensor(c) for c in cols))
    return tokens.tolist(), logprobs.tolist()


def applied(proc: CounterDraws, x: torch.Tensor) -> tuple[list[int], dict[tuple[int, int], float]]:
    """One step: the tokens vLLM's argmax takes from the processed logits, and the log-probs handed back."""
    out = proc.apply(x.clone())
    table: dict[tuple[int, int], float] = {}
    for drawn in handed_back(7):
        table.update(drawn.items())
    return out.argmax(-1).tolist(), table


@pytest.fixture
def proc() -> CounterDraws:
    handed_back(7)
    return CounterDraws(8, CPU, pin=False, key=_KEY)


def test_rows_draw_what_the_native_sampler_draws_and_move_on_as_their_outputs_grow(proc):
    reqs = [request(10, 1), request(11, 2, offset=5, temperature=0.7), request(12, 3, temperature=0.0),
            request(13, 4, top_k=3), request(-15, 5, top_p=0.8)]  # fmt: skip
    # (uid -15: the migration audit's copies have negative uids)
    draws = [p.extra_args[_KEY] for p, _ in reqs]
    proc.update_state(update(5, added=[(i, p, None, out) for i, (p, out) in enumerate(reqs)]))
    for step in range(4):
        x = logits(5, step)
        tokens, table = applied(proc, x)
        positions = [d.offset + len(out) for d, (_, out) in zip(draws, reqs, strict=True)]
        want_tokens, want_lp = native(x, draws, positions)
        assert tokens == want_tokens
        assert table == {(d.uid, p): lp for d, p, lp in zip(draws, positions, want_lp, strict=True)}
        for (_, out), tok in zip(reqs, tokens, strict=True):
            out.append(tok)  # vLLM keeps the token
        proc.update_state(None)
    assert proc.table[:5, 1].tolist() == [4, 9, 4, 4, 4]  # positions moved on, on the device


def test_a_discarded_token_is_drawn_again_at_the_same_position(proc):
    """vLLM samples a request still prefilling in chunks and throws the token away: the position stays."""
    (p, out), (q, out2) = request(20, 9), request(21, 8)
    proc.update_state(update(2, added=[(0, p, None, out), (1, q, None, out2)]))
    x = logits(2, 0)
    first, _ = applied(proc, x)
    out2.append(first[1])  # row 0's token discarded, row 1's kept
    proc.update_state(None)
    again, table = applied(proc, x)
    assert again[0] == first[0] and (20, 0) in table and (21, 1) in table
    assert proc.table[:2, 1].tolist() == [1, 2]


def test_moved_and_removed_rows_keep_their_own_draws(proc):
    reqs = [request(30 + i, 100 + i) for i in range(4)]
    draws = [p.extra_args[_KEY] for p, _ in reqs]
    proc.update_state(update(4, added=[(i, p, None, out) for i, (p, out) in enumerate(reqs)]))
    reqs[2][1].extend([5, 6])  # (as if it had drawn two tokens before)
    proc.update_state(update(3, removed=[1], moved=[(0, 2, Move.SWAP), (3, 1, Move.UNIDIRECTIONAL)]))
    order = [2, 3, 0]  # rows now hold requests 32, 33, 30
    x = logits(3, 4)
    tokens, table = applied(proc, x)
    positions = [len(reqs[i][1]) for i in order]
    want_tokens, want_lp = native(x, [draws[i] for i in order], positions)
    assert tokens == want_tokens and positions == [2, 0, 0]
    assert table == {(30 + i, p): lp for i, p, lp in zip(order, positions, want_lp, strict=True)}


def test_rows_without_a_draw_are_left_as_they_are(proc):
    p, out = request(40, 1)
    proc.update_state(update(3, added=[(0, p, None, out), (1, SimpleNamespace(extra_args=None), None, []),
                                       (2, SimpleNamespace(extra_args={}), None, [])]))  # fmt: skip
    x = logits(3, 2)
    y = proc.apply(x.clone())
    assert torch.equal(y[1:], x[1:])
    assert int(torch.isfinite(y[0]).sum()) == 1
    assert [k for d in handed_back(7) for k, _ in d.items()] == [(40, 0)]
    only_theirs = CounterDraws(4, CPU, pin=False, key=_KEY)
    only_theirs.update_state(update(1, added=[(0, SimpleNamespace(extra_args=None), None, [])]))
    assert only_theirs.apply(x[:1]) is not None and handed_back(7) == []


class _Transfers(TorchDispatchMode):
    """Copies between the host and the meta device (where reading a value raises): device-to-host copies are
    recorded and skipped (meta tensors hold no data), host-to-device ones recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.back: list[tuple[int, ...]] = []
        self.sent: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type == "meta":
                self.back.append(tuple(dst.shape))
                return dst
            if dst.device.type == "meta" and src.device.type == "cpu":
                self.sent.append(tuple(src.shape))
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu":
            if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
                self.sent.append(tuple(args[0].shape))
        return func(*args, **kwargs)


def test_apply_neither_reads_the_device_nor_sends_it_anything():
    """On the meta device any read of a value raises; what crosses is recorded: apply sends nothing and brings
    back one vector of log-probs, update_state sends the table (and the filtered rows) when rows change."""
    handed_back(7)
    meta = torch.device("meta")
    proc = CounterDraws(8, meta, pin=False, key=_KEY)
    reqs = [request(50, 1), request(51, 2, temperature=0.0), request(52, 3, top_k=4, temperature=0.5)]
    with _Transfers() as seen:
        proc.update_state(update(3, added=[(i, p, None, out) for i, (p, out) in enumerate(reqs)]))
    assert seen.sent and not seen.back
    for _ in range(3):
        with _Transfers() as seen:
            out = proc.apply(torch.empty(3, VOCAB, device=meta))
        assert out.shape == (3, VOCAB) and seen.sent == [] and seen.back == [(3,)]
        for _, o in reqs:
            o.append(0)
        with _Transfers() as seen:
            proc.update_state(None)  # every output grew by one: the device's positions are right already
        assert seen.sent == []
    assert len(handed_back(7)) == 3
