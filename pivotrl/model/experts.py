"""The experts of a Qwen3-MoE layer, stacked, and the names they have in checkpoints.

Why stacked. A grouped matmul (``torch.nn.functional.grouped_mm``) takes every expert's weights as one
``[E, ...]`` tensor and the tokens sorted by expert, and runs all experts in one call, with no host sync on
the GPUs that have its kernel. So the experts of a layer are two parameters, as transformers holds them:
``gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj`` ``[E, H, I]``.
A stacked parameter also has a gradient as a whole, zero in the rows of an expert no token chose, which
FSDP2 needs: it reduce-scatters the parameters that have gradients, and every rank must hold the same ones.

Why checkpoint names. Checkpoints, the GPS and vLLM name one tensor per expert and projection
(``...mlp.experts.7.gate_proj.weight``). Each such tensor is a contiguous span of a stacked parameter's
storage: expert e's gate rows, then its up rows, within ``gate_up_proj[e]``. :func:`checkpoint_parts` says
which span carries which name; the module's ``state_dict`` speaks those names (views into the parameters:
writing into them writes the weights), ``load_state_dict`` takes them (or the stacked names), and the
trainers, which read and write parameters by name, copy spans with :func:`copy_span`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GATE_UP, DOWN = "gate_up_proj", "down_proj"
MAX_GROUPS = 1023  # the CUDA grouped kernel refuses 1024 groups or more


@dataclass(frozen=True, slots=True)
class Part:
    """One checkpoint tensor inside a parameter: its name, where its elements start in the parameter's
    flattened storage, and its shape."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def checkpoint_parts(name: str, shape: Sequence[int]) -> tuple[Part, ...]:
    """The checkpoint tensors parameter ``name`` of ``shape`` holds, in storage order: the per-expert
    projections of a stacked expert parameter, else the parameter itself under its own name."""
    prefix, _, leaf = name.rpartition(".")
    shape = tuple(int(s) for s in shape)
    if not prefix.endswith(".experts") or leaf not in (GATE_UP, DOWN) or len(shape) != 3:
        return (Part(name, 0, shape),)
    experts, rows, cols = shape
    if leaf == DOWN:
        return tuple(Part(f"{prefix}.{e}.down_proj.weight", e * rows * cols, (rows, cols)) for e in range(experts))
    half = rows // 2
    return tuple(
        Part(f"{prefix}.{e}.{proj}.weight", (e * rows + i * half) * cols, (half, cols))
        for e in range(experts)
        for i, proj in enumerate(("gate_proj", "up_proj"))
    )


def part_view(flat: Tensor, part: Part) -> Tensor:
    """``part`` of a parameter whose flattened storage is ``flat`` (a view: writing into it writes ``flat``)."""
    return flat[part.offset : part.offset + part.numel].view(part.shape)


def copy_span(dst: Tensor, tensors: Mapping[str, Tensor], name: str, shape: Sequence[int], start: int) -> None:
    """Fill ``dst`` (1-D) with elements ``start ..`` of parameter ``name``'s flattened storage, read from
    ``tensors`` by checkpoint name. KeyError: a checkpoint tensor is not there (its name); ValueError: one
    has another shape than the parameter's part."""
    stop = start + dst.numel()
    for part in checkpoint_parts(name, shape):
        lo, hi = max(start, part.offset), min(stop, part.offset + part.numel)
        if lo >= hi:
            continue
        if part.name not in tensors:
            raise KeyError(part.name)
        src = tensors[part.name]
        if tuple(src.shape) != part.shape:
            raise ValueError(f"{part.name}: stored shape {tuple(src.shape)} vs model {part.shape}")
        dst[lo - start : hi - start].copy_(src.reshape(-1)[lo - part.offset : hi - part.offset])


def per_expert_order(params: Sequence[tuple[str, Sequence[int]]]) -> list[Part]:
    """The checkpoint tensors of ``params`` (names and shapes, in the module's order) in the order of a decoder
    that holds one parameter per expert and projection, each expert's gate, up and down in turn where the stacked
    layer has ``gate_up_proj`` then ``down_proj``: the order train state written by such a decoder follows
    (offsets: into that order's flat concatenation)."""
    out: list[Part] = []
    offset, i = 0, 0
    while i < len(params):
        name, shape = params[i]
        pair = name.endswith(f".experts.{GATE_UP}") and i + 1 < len(params)
        pair = pair and params[i + 1][0] == name.removesuffix(GATE_UP) + DOWN
        if pair:
            gate_up, down = checkpoint_parts(name, shape), checkpoint_parts(*params[i + 1])
            parts = [p for e, d in enumerate(down) for p in (gate_up[2 * e], gate_up[2 * e + 1], d)]
            i += 2
        else:
            parts, i = list(checkpoint_parts(name, shape)), i + 1
        for p in parts:
            out.append(Part(p.name, offset, p.shape))
            offset += p.numel
    return out


def grouped_kernel(x: Tensor, *weights: Tensor) -> bool:
    """Whether ``grouped_mm`` has a kernel for tokens ``x`` [S, K] against stacked ``weights`` [E, N, K]
    (transposed) here, so that the experts run in one call without a host sync.

    torch 2.13: on CUDA the grouped kernel runs for bfloat16 on compute capability 9.x and 10.x (other GPUs
    and dtypes take a fallback that copies the offsets to the host and loops); on the CPU every expert runs
    in one call for float32, bfloat16 and float16. Both check that each operand's leading stride is a
    multiple of 16 bytes, and CUDA that data starts at a 16-byte boundary.
    """
    if any(w.dtype != x.dtype or w.device != x.device or w.shape[0] > MAX_GROUPS for w in weights):
        return False
    align = 16 // x.element_size()
    if any(w.shape[1] % align or w.shape[2] % align for w in weights):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        major = torch.cuda.get_device_capability(x.device)[0]
        aligned = all(t.data_ptr() % 16 == 0 for t in (x, *weights))
        return x.dtype == torch.bfloat16 and major in (9, 10) and aligned
    return False


def group_offsets(sorted_experts: Tensor, experts: int) -> Tensor:
    """``grouped_mm``'s offsets for pairs sorted by expert: where each expert's group ends, int32, computed on
    the pairs' device (``bincount`` would read its input's maximum on the host)."""
    ids = torch.arange(experts, device=sorted_experts.device, dtype=sorted_experts.dtype)
    return torch.searchsorted(sorted_experts, ids, right=True, out_int32=True)


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts of one layer as two stacked parameters (see the module's docstring).

    ``forward(x, chosen, weights)``: token n's output is the sum over its k slots of ``weights[n, j]`` times
    expert ``chosen[n, j]`` applied to ``x[n]``. The (token, expert) pairs are sorted by expert; where
    :func:`grouped_kernel` holds, two grouped matmuls run every expert on its rows (offsets computed on the
    device); elsewhere a loop runs only the experts chosen (their counts read on the host: :class:`LoopedMM`).
    Either way the stacked parameters' gradients are whole, zero for an expert no token chose.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.reset_parameters()
        self.register_state_dict_post_hook(_to_checkpoint_names)
        self.register_load_state_dict_pre_hook(_from_checkpoint_names)

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initialises its weight: uniform within 1 / sqrt(fan_in)."""
        for w in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        n, k = chosen.shape
        experts, order = chosen.flatten().sort(stable=True)  # the n * k (token, expert) pairs, grouped by expert
        rows = x.index_select(0, order // k)
        if grouped_kernel(rows, self.gate_up_proj, self.down_proj):
            y = self._grouped(rows, group_offsets(experts, self.num_experts))
        else:
            y = self._looped(rows, experts)
        pairs = y.new_empty(y.shape).index_copy(0, order, y)  # back in (token, slot) order
        return torch.bmm(weights.unsqueeze(1), pairs.view(n, k, x.shape[1])).squeeze(1)

    def _grouped(self, rows: Tensor, offsets: Tensor) -> Tensor:
        gate, up = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)

    def _looped(self, rows: Tensor, experts: Tensor) -> Tensor:
        counts = torch.bincount(experts, minlength=self.num_experts).tolist()
        gate, up = LoopedMM.apply(rows, self.gate_up_proj, counts).chunk(2, dim=-1)
        return LoopedMM.apply(F.silu(gate) * up, self.down_proj, counts)


class LoopedMM(torch.autograd.Function):
    """``grouped_mm`` where torch has no kernel: rows ``a`` [S, K] sorted by group, group e's ``counts[e]`` rows
    times ``weight[e]``.T ([E, N, K]), one matmul per group that has rows, each written into one output. Its
    backward writes each group's weight gradient into one ``[E, N, K]`` tensor (zeros for a group without rows),
    so no per-expert gradient is made and then stacked."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
        ctx.save_for_backward(a, weight)
        ctx.counts = counts
        out = a.new_empty(a.shape[0], weight.shape[1])
        for e, (lo, hi) in _spans(counts):
            torch.mm(a[lo:hi], weight[e].t(), out=out[lo:hi])
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        a, weight = ctx.saved_tensors
        grad_a = a.new_empty(a.shape) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = weight.new_empty(weight.shape)
            for e, count in enumerate(ctx.counts):
                if not count:
                    grad_w[e].zero_()
        for e, (lo, hi) in _spans(ctx.counts):
            if grad_a is not None:
                torch.mm(grad[lo:hi], weight[e], out=grad_a[lo:hi])
            if grad_w is not None:
                torch.mm(grad[lo:hi].t(), a[lo:hi], out=grad_w[e])
        return grad_a, grad_w, None


def _spans(counts: list[int]) -> list[tuple[int, tuple[int, int]]]:
    """(group, its rows) for each group with rows."""
    out, start = [], 0
    for e, count in enumerate(counts):
        if count:
            out.append((e, (start, start + count)))
        start += count
    return out


def _to_checkpoint_names(module: Experts, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict``: each stacked parameter as its checkpoint tensors, views into it."""
    for leaf in (GATE_UP, DOWN):
        t = state.pop(prefix + leaf)
        flat = t.detach().view(-1)
        for part in checkpoint_parts(prefix + leaf, t.shape):
            state[part.name] = part_view(flat, part)


def _from_checkpoint_names(module: Experts, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict``: checkpoint tensors stacked into the parameters' names. Left as they are where
    the stacked name is given already, or where one is missing or has another shape (the load then names
    what is missing and what is unexpected)."""
    for leaf in (GATE_UP, DOWN):
        param = getattr(module, leaf)
        parts = checkpoint_parts(prefix + leaf, param.shape)
        if prefix + leaf in state or not all(p.name in state and tuple(state[p.name].shape) == p.shape for p in parts):
            continue
        flat = torch.empty(param.numel(), dtype=state[parts[0].name].dtype, device=state[parts[0].name].device)
        for p in parts:
            part_view(flat, p).copy_(state.pop(p.name))
        state[prefix + leaf] = flat.view(param.shape)
