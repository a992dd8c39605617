"""Stacked, grouped experts: the same numbers as the loop they replaced, and the checkpoints' per-expert names at
every boundary."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks.moe import loop_of
from pivotrl.model import Decoder
from pivotrl.model.decoder import SparseMoE
from pivotrl.model.experts import LoopedMM, checkpoint_parts, copy_span, group_offsets, grouped_kernel
from tests.conftest import tiny_moe_config


def sparse_layer(hidden: int, width: int, experts: int = 8, top_k: int = 2, seed: int = 0) -> SparseMoE:
    cfg = replace(tiny_moe_config(), hidden_size=hidden, moe_intermediate_size=width, num_experts=experts,
                  num_experts_per_tok=top_k, norm_topk_prob=True)  # fmt: skip
    torch.manual_seed(seed)
    return SparseMoE(cfg)


@pytest.mark.parametrize(("hidden", "width", "grouped"), [(16, 8, True), (18, 6, False)], ids=["grouped", "looped"])
def test_the_layer_equals_the_loop_it_replaced(hidden, width, grouped):
    """Three tokens choose at most six of eight experts: outputs and every gradient (the unchosen experts' zero)
    agree with the per-expert loop on the same weights, by grouped_mm (16-byte rows) or by the loop over the
    chosen experts (rows of 18 or 6 floats)."""
    layer = sparse_layer(hidden, width)
    loop = loop_of(layer)
    x = torch.randn(3, hidden)
    assert grouped_kernel(x, layer.experts.gate_up_proj, layer.experts.down_proj) is grouped
    grad = torch.randn(3, hidden)
    got, want = {}, {}
    for module, out in ((layer, got), (loop, want)):
        layer.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_(True)
        y = module(xs)
        y.backward(grad)
        out.update(y=y.detach(), x=xs.grad, router=layer.gate.weight.grad)
        if module is layer:
            got.update(gate_up=layer.experts.gate_up_proj.grad, down=layer.experts.down_proj.grad)
    want["gate_up"] = torch.stack([torch.cat([m.gate_proj.weight.grad, m.up_proj.weight.grad]) for m in loop.experts])
    want["down"] = torch.stack([m.down_proj.weight.grad for m in loop.experts])
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6, msg=key)
    unused = got["down"].abs().sum(dim=(1, 2)) == 0
    assert 2 <= int(unused.sum()) < 8 and bool((got["gate_up"][unused] == 0).all())


def test_the_loop_without_a_kernel_has_the_gradients_of_its_matmuls():
    counts = [2, 0, 3, 1]  # (a group with no rows: zero gradient)
    a = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: LoopedMM.apply(a, w, counts), (a, w))
    LoopedMM.apply(a, w, counts).sum().backward()
    assert bool((w.grad[1] == 0).all()) and bool((w.grad[[0, 2, 3]] != 0).all())


def test_group_offsets_end_each_expert_on_the_device_of_the_pairs():
    experts = torch.tensor([1, 1, 2, 4, 4, 4])  # experts 0, 3 and 5 unchosen, at either end and between
    offsets = group_offsets(experts, 6)
    assert offsets.dtype == torch.int32 and offsets.device == experts.device
    assert offsets.tolist() == torch.bincount(experts, minlength=6).cumsum(0).tolist() == [0, 2, 3, 3, 6, 6]


def test_grouped_kernel_only_where_torch_has_one():
    w = torch.zeros(4, 8, 16)
    assert grouped_kernel(torch.zeros(3, 16), w)
    assert grouped_kernel(torch.zeros(3, 16, dtype=torch.bfloat16), w.bfloat16())
    assert not grouped_kernel(torch.zeros(3, 16, dtype=torch.bfloat16), w)  # dtypes differ
    assert not grouped_kernel(torch.zeros(3, 16, dtype=torch.float64), w.double())  # no kernel for float64
    assert grouped_kernel(torch.zeros(3, 12), torch.zeros(4, 8, 12))  # 48-byte rows: fine ...
    assert not grouped_kernel(torch.zeros(3, 16), torch.zeros(4, 6, 16))  # ... 24-byte ones are not
    assert not grouped_kernel(torch.zeros(3, 16, device="meta"), w.to("meta"))


def test_checkpoint_parts_tile_the_stacked_parameters():
    name = "model.layers.3.mlp.experts.gate_up_proj"
    parts = checkpoint_parts(name, (3, 8, 5))
    assert [p.name for p in parts[:3]] == [
        "model.layers.3.mlp.experts.0.gate_proj.weight",
        "model.layers.3.mlp.experts.0.up_proj.weight",
        "model.layers.3.mlp.experts.1.gate_proj.weight",
    ]
    assert [p.offset for p in parts] == [20 * i for i in range(6)] and {p.shape for p in parts} == {(4, 5)}
    (down,) = checkpoint_parts("model.layers.3.mlp.experts.down_proj", (3, 5, 4))[2:]
    assert (down.name, down.offset, down.shape) == ("model.layers.3.mlp.experts.2.down_proj.weight", 40, (5, 4))
    assert checkpoint_parts("model.layers.3.mlp.gate.weight", (3, 5))[0].name == "model.layers.3.mlp.gate.weight"
    stacked = torch.randn(3, 8, 5)
    named = {p.name: stacked.view(-1)[p.offset : p.offset + p.numel].view(p.shape) for p in parts}
    window = torch.empty(33)
    copy_span(window, named, name, stacked.shape, 17)  # (across parts and experts)
    assert torch.equal(window, stacked.view(-1)[17:50])
    with pytest.raises(KeyError, match="experts.1.gate_proj"):
        copy_span(window, {k: v for k, v in named.items() if "1.gate" not in k}, name, stacked.shape, 17)
    copy_span(window, {k: v for k, v in named.items() if "2." not in k}, name, stacked.shape, 17)  # (not read)
    with pytest.raises(ValueError, match=r"experts.0.up_proj.weight: stored shape \(5, 4\) vs model \(4, 5\)"):
        copy_span(window, {**named, parts[1].name: torch.zeros(5, 4)}, name, stacked.shape, 17)


def test_state_dict_speaks_per_expert_names_and_round_trips():
    """What checkpoints, the GPS and vLLM see: one tensor per expert and projection, as views (a load writes
    the weights through them); either those names or the stacked ones (transformers' own) load back."""
    model = Decoder(tiny_moe_config())
    state = model.state_dict()
    prefix = "model.layers.0.mlp.experts"
    assert {f"{prefix}.15.gate_proj.weight", f"{prefix}.15.up_proj.weight", f"{prefix}.15.down_proj.weight"} <= set(
        state
    )
    assert not any(k.startswith(f"{prefix}.gate_up") or k.startswith(f"{prefix}.down") for k in state)
    width = model.config.moe_intermediate_size
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(state[f"{prefix}.3.up_proj.weight"], experts.gate_up_proj[3, width:])
    with torch.no_grad():
        model.state_dict(keep_vars=True)[f"{prefix}.3.down_proj.weight"].fill_(7.0)
    assert bool((experts.down_proj[3] == 7).all()) and not bool((experts.down_proj[2] == 7).all())

    copy = Decoder(tiny_moe_config())
    copy.load_state_dict(model.state_dict())
    stacked = {n: p.detach() for n, p in model.named_parameters()}
    assert f"{prefix}.gate_up_proj" in stacked
    again = Decoder(tiny_moe_config())
    again.load_state_dict(stacked)
    for name, p in model.named_parameters():
        assert torch.equal(dict(copy.named_parameters())[name], p), name
        assert torch.equal(dict(again.named_parameters())[name], p), name
    missing = {k: v for k, v in model.state_dict().items() if k != f"{prefix}.9.gate_proj.weight"}
    with pytest.raises(RuntimeError, match="experts.gate_up_proj"):
        Decoder(tiny_moe_config()).load_state_dict(missing)


@pytest.mark.parametrize(("hidden", "width"), [(16, 8), (18, 6)], ids=["grouped", "looped"])
def test_no_tokens_still_give_every_expert_a_gradient(hidden, width):
    """A pass over no tokens (a rank with nothing left in lockstep) leaves the same parameters with gradients."""
    layer = sparse_layer(hidden, width)
    x = torch.zeros(0, hidden, requires_grad=True)
    layer(x).sum().backward()
    for p in (layer.experts.gate_up_proj, layer.experts.down_proj):
        assert p.grad is not None and not p.grad.any()
