"""MoE layer: forward + backward of one Qwen3-30B-A3B-shaped sparse layer, grouped experts against the loop.

The layer: 128 experts, top 8 of them per token, hidden size 2048, expert width 768 (Qwen3-30B-A3B's), on
4,096 tokens, under autograd as training runs it. Two implementations on the same inputs and the same weights
(the loop's experts are views of the grouped layer's stacked weights), in the same run, interleaved within each
repetition, the median reported:

* ``loop``: the sparse block as it was before its experts were stacked, kept here as the reference: one
  ``bincount().tolist()`` (a host sync on a GPU) and a Python loop over every expert, each an ``MLP`` of three
  ``nn.Linear`` on the tokens routed to it, every expert run (on no tokens where none chose it) so that each has
  a gradient.
* ``grouped``: ``pivotrl.model.decoder.SparseMoE`` as it is: the (token, expert) pairs sorted by expert and
  one grouped matmul per projection where torch has the kernel (``pivotrl.model.experts.grouped_kernel``), else
  a loop over the chosen experts only.

Beside them, ``dense floor``: the same matmul FLOPs as two plain matmuls of all 32,768 (token, expert) rows
against one expert's weights, no routing: what any grouping can at best reach on this device. On a CPU the
experts' matmuls are most of the time and both implementations run the same ones, so the floor bounds the
speedup there; the loop's host sync, its launches and its per-expert overhead are what a GPU gains from.

Before timing, outputs and gradients of the two are compared (max abs difference, reported). dtype: bfloat16 on
a GPU and on a CPU with bf16 instructions (AVX512-BF16 or AMX), else float32 (a CPU without them runs bf16
matmuls several times slower than fp32); the report says which and why.

    python benchmarks/moe.py [--device cpu|cuda] [--tokens 4096] [--reps 3] [--out benchmarks/results/moe.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_report  # noqa: E402
from pivotrl.model import ModelConfig  # noqa: E402
from pivotrl.model.decoder import MLP, SparseMoE, route  # noqa: E402
from pivotrl.model.experts import grouped_kernel  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "moe.json"


@dataclass(frozen=True)
class Shape:
    experts: int = 128
    top_k: int = 8
    hidden: int = 2048
    width: int = 768  # moe_intermediate_size

    def config(self) -> ModelConfig:
        return ModelConfig(
            architecture="Qwen3MoeForCausalLM",
            vocab_size=128,
            hidden_size=self.hidden,
            intermediate_size=4 * self.hidden,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=self.hidden // 4,
            num_experts=self.experts,
            num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.width,
            norm_topk_prob=True,
        )


class LoopMoE(nn.Module):
    """The sparse block before its experts were stacked (the reference): the same router, one ``MLP`` per expert."""

    def __init__(self, gate: nn.Linear, experts: list[MLP], top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = gate
        self.experts = nn.ModuleList(experts)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = route(self.gate, x, self.top_k, self.norm_topk_prob)
        weights, chosen = weights.flatten(), chosen.flatten()
        order = chosen.argsort(stable=True)  # the N * k (token, expert) pairs, grouped by expert
        counts = torch.bincount(chosen, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        all_experts = torch.is_grad_enabled()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n or all_experts:
                pairs = order[start : start + n]
                rows = tokens[start : start + n]
                out.index_add_(0, rows, (expert(x.index_select(0, rows)) * weights[pairs, None]).to(out.dtype))
            start += n
        return out.view(shape)


def loop_of(layer: SparseMoE) -> LoopMoE:
    """The reference over ``layer``'s weights: each expert's three projections are parameters of their own that
    view the stacked weights (no copy; gradients of their own)."""
    gate_up, down = layer.experts.gate_up_proj.detach(), layer.experts.down_proj.detach()
    width = down.shape[2]
    experts = []
    for e in range(gate_up.shape[0]):
        with torch.device("meta"):
            mlp = MLP(down.shape[1], width)
        mlp.gate_proj.weight = nn.Parameter(gate_up[e, :width])
        mlp.up_proj.weight = nn.Parameter(gate_up[e, width:])
        mlp.down_proj.weight = nn.Parameter(down[e])
        experts.append(mlp)
    return LoopMoE(layer.gate, experts, layer.top_k, layer.norm_topk_prob)


class ChosenLoop(nn.Module):
    """The grouped layer's other path, where ``grouped_mm`` has no kernel: a loop over the chosen experts only,
    on the same stacked weights."""

    def __init__(self, layer: SparseMoE) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        layer = self.layer
        probs = F.softmax(layer.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(layer.top_k, dim=-1)
        if layer.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        n, k = chosen.shape
        experts, order = chosen.flatten().sort(stable=True)
        y = layer.experts._looped(x.index_select(0, order // k), experts)
        pairs = y.new_empty(y.shape).index_copy(0, order, y)
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), pairs.view(n, k, -1)).squeeze(1)


class DenseFloor(nn.Module):
    """The experts' matmul FLOPs with no routing: every (token, expert) row through one expert's SwiGLU."""

    def __init__(self, layer: SparseMoE) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(layer.experts.gate_up_proj.detach()[0])
        self.down = nn.Parameter(layer.experts.down_proj.detach()[0])
        self.top_k = layer.top_k

    def forward(self, x: Tensor) -> Tensor:
        rows = x.repeat_interleave(self.top_k, dim=0)
        gate, up = F.linear(rows, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down).view(x.shape[0], self.top_k, -1).sum(1)


def pick_dtype(device: str) -> tuple[torch.dtype, str]:
    if device != "cpu":
        return torch.bfloat16, "a GPU: bf16, as training and serving run there"
    flags: set[str] = set()
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if found:
        return torch.bfloat16, f"this CPU has {', '.join(found)}"
    return torch.float32, "this CPU has no bf16 instructions (neither avx512_bf16 nor amx_bf16): float32"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def max_abs(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def measure(shape: Shape, tokens: int, reps: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """Seconds of forward + backward of each variant (every repetition), and how far the loop's outputs and
    gradients are from the grouped layer's."""
    torch.manual_seed(seed)
    with torch.device(device):
        layer = SparseMoE(shape.config()).to(dtype)
    loop, floor = loop_of(layer), DenseFloor(layer)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device, dtype=dtype)
    grad = torch.randn(tokens, shape.hidden, generator=gen, device=device, dtype=dtype)
    modules = {"loop": loop, "grouped": layer, "chosen loop": ChosenLoop(layer), "dense floor": floor}

    def step(name: str) -> Tensor:
        for p in modules[name].parameters():
            p.grad = None
        xs = x.clone().requires_grad_(True)
        out = modules[name](xs)
        out.backward(grad)
        return xs.grad

    # the first (untimed) pass of each: warm-up, and the comparison of the two implementations
    new_x = step("grouped")
    router = layer.gate.weight.grad
    old_x = step("loop")
    experts = layer.experts
    width = shape.width
    diffs = {"input_grad": max_abs(new_x, old_x), "router_grad": max_abs(router, layer.gate.weight.grad)}
    with torch.no_grad():
        diffs["output"] = max_abs(layer(x), loop(x))
    diffs["expert_grads"] = 0.0
    for e, mlp in enumerate(loop.experts):
        for got, want in ((experts.gate_up_proj.grad[e, :width], mlp.gate_proj.weight.grad),
                          (experts.gate_up_proj.grad[e, width:], mlp.up_proj.weight.grad),
                          (experts.down_proj.grad[e], mlp.down_proj.weight.grad)):  # fmt: skip
            diffs["expert_grads"] = max(diffs["expert_grads"], max_abs(got, want))
    del new_x, old_x, router
    step("chosen loop")
    step("dense floor")
    for m in modules.values():
        for p in m.parameters():
            p.grad = None
    seconds: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(reps):
        for name in modules:  # interleaved: a busy machine slows every variant of a repetition alike
            seconds[name].append(timed(lambda name=name: step(name), device))
    routed = tokens * shape.top_k
    flops = 3 * 2 * routed * 3 * shape.hidden * width  # forward (3 matmuls) + backward (2x), 2 FLOPs a MAC
    rows = {}
    for name, s in seconds.items():
        median = statistics.median(s)
        rows[name] = {"seconds": [round(v, 4) for v in s], "median_s": round(median, 4),
                      "gflops_per_s": round(flops / median / 1e9, 1)}  # fmt: skip
    loop_s, grouped_s = rows["loop"]["median_s"], rows["grouped"]["median_s"]
    return {
        "variants": rows,
        "speedup": round(loop_s / grouped_s, 3),
        "floor_over_grouped": round(rows["dense floor"]["median_s"] / grouped_s, 3),
        "expert_matmul_gflop": round(flops / 1e9, 1),
        "grouped_kernel": grouped_kernel(x, experts.gate_up_proj, experts.down_proj),
        "max_abs_diff_loop_vs_grouped": {k: float(f"{v:.3g}") for k, v in diffs.items()},
    }


def table(report: dict[str, Any]) -> str:
    s = report["shape"]
    head = (f"MoE layer forward + backward: {report['tokens']} tokens, {s['experts']} experts top {s['top_k']}, "
            f"hidden {s['hidden']}, expert width {s['width']}, {report['dtype']} on {report['device_name']}, "
            f"median of {report['reps']}")  # fmt: skip
    lines = [head, f"{'variant':<14} {'median s':>10} {'GFLOP/s':>9} {'vs loop':>8}"]
    loop = report["variants"]["loop"]["median_s"]
    for name, row in report["variants"].items():
        lines.append(f"{name:<14} {row['median_s']:>10.4f} {row['gflops_per_s']:>9.1f} {loop / row['median_s']:>7.2f}x")
    d = report["max_abs_diff_loop_vs_grouped"]
    lines.append(f"speedup (loop / grouped): {report['speedup']:.2f}x; grouped kernel: {report['grouped_kernel']}; "
                 f"loop vs grouped max|d|: output {d['output']:.1e}, input grad {d['input_grad']:.1e}, "
                 f"expert grads {d['expert_grads']:.1e}")  # fmt: skip
    return "\n".join(lines)


def run(device: str, tokens: int, reps: int, shape: Shape | None = None) -> dict[str, Any]:
    """The report: the measurement with the machine, the dtype and why (default shape: Qwen3-30B-A3B's)."""
    shape = shape or Shape()
    load = list(os.getloadavg())
    dtype, why = pick_dtype(device)
    result = measure(shape, tokens, reps, device, dtype)
    threads = torch.get_num_threads()
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"cpu, {threads} thread(s)"
    return {
        "device": device,
        "device_name": name,
        "dtype": str(dtype).removeprefix("torch."),
        "dtype_reason": why,
        "shape": asdict(shape),
        "tokens": tokens,
        "reps": reps,
        "torch": torch.__version__,
        **result,
        "machine": machine(load),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each variant (after one untimed)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (a CPU device has one)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON report")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device")
    report = run(args.device, args.tokens, args.reps)
    print(table(report))
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
