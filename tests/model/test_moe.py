"""Qwen3-MoE beyond logits parity (which test_parity runs for its MoE cases): the config's expert fields,
routing that the checks would notice if it were wrong, generation through the KV cache, and training.
"""

import json
import random
from dataclasses import replace

import pytest
import torch
from transformers import Qwen3MoeConfig

from pivotrl.engine import Engine, SamplingParams, SeqState
from pivotrl.model import Decoder, ModelConfig, UnsupportedModelError, load_model
from pivotrl.model.decoder import MLP, SparseMoE
from pivotrl.sample import Sample
from pivotrl.train.config import TrainConfig
from pivotrl.train.grpo import GRPOTrainer
from tests.model.test_parity import CASES, TOL, VOCAB, hf_model, max_diff, token_batch, write_checkpoint

MOE_CASES = [name for name, (cls, _) in CASES.items() if cls is Qwen3MoeConfig]


@pytest.fixture(params=MOE_CASES, scope="module")
def case(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def moe(case, tmp_path_factory) -> Decoder:
    path = tmp_path_factory.mktemp(case)
    write_checkpoint(case, path)
    return load_model(path)[0]


def sparse_layers(model: Decoder) -> list[SparseMoE]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]


# --- config ---------------------------------------------------------------------------------


def test_sparse_and_dense_layers_where_transformers_puts_them(case, moe):
    reference = hf_model(case)
    theirs = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in reference.model.layers]
    ours = [isinstance(layer.mlp, SparseMoE) for layer in moe.model.layers]
    assert ours == theirs
    assert True in ours and False in ours, "the case should mix sparse and dense layers"
    for layer in moe.model.layers:
        if isinstance(layer.mlp, MLP):
            assert layer.mlp.up_proj.out_features == moe.config.intermediate_size


def test_to_hf_round_trips_the_expert_fields(moe):
    cfg = moe.config
    raw = json.loads(json.dumps(cfg.to_hf()))
    assert ModelConfig.from_hf(raw) == cfg
    theirs = Qwen3MoeConfig.from_dict(raw)
    assert theirs.num_experts == cfg.num_experts  # "num_experts", as on the Hub, reaches transformers
    assert theirs.num_experts_per_tok == cfg.num_experts_per_tok
    assert theirs.moe_intermediate_size == cfg.moe_intermediate_size
    assert theirs.norm_topk_prob == cfg.norm_topk_prob
    assert theirs.decoder_sparse_step == cfg.decoder_sparse_step
    assert theirs.mlp_only_layers == cfg.mlp_only_layers


def test_dense_config_json_has_no_expert_fields():
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_experts": 8,  # ignored: a dense architecture
        }
    )
    assert cfg.num_experts == 0
    assert not {"num_experts", "moe_intermediate_size", "mlp_only_layers"} & cfg.to_hf().keys()


def test_absent_expert_keys_take_transformers_defaults(moe):
    raw = moe.config.to_hf()
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        del raw[key]
    cfg, theirs = ModelConfig.from_hf(raw), Qwen3MoeConfig()
    assert cfg.num_experts == theirs.num_experts
    assert cfg.num_experts_per_tok == theirs.num_experts_per_tok
    assert cfg.moe_intermediate_size == theirs.moe_intermediate_size
    assert cfg.norm_topk_prob == theirs.norm_topk_prob


@pytest.mark.parametrize(
    "change, match",
    [
        pytest.param({"num_experts": -1}, "num_experts -1", id="negative-experts"),
        pytest.param({"num_experts_per_tok": 0}, "num_experts_per_tok 0", id="no-top-k"),
        pytest.param({"num_experts_per_tok": 6}, "num_experts_per_tok 6; allowed: 1..num_experts", id="top-k>E"),
        pytest.param({"moe_intermediate_size": 0}, "moe_intermediate_size", id="no-expert-width"),
        pytest.param({"decoder_sparse_step": 0}, "decoder_sparse_step", id="sparse-step"),
        pytest.param({"mlp_only_layers": [3]}, r"mlp_only_layers \[3\]; allowed: layer indices 0..2", id="layer"),
        pytest.param({"architecture": "Qwen3ForCausalLM"}, "Qwen3MoeForCausalLM", id="dense-architecture"),
    ],
)
def test_invalid_expert_config_names_the_field(change, match):
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=64,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=20,
    )
    with pytest.raises(UnsupportedModelError, match=match):
        replace(cfg, **change)


# --- routing ---------------------------------------------------------------------------------


@torch.no_grad()
def test_routing_choices_reach_the_logits(moe):
    """Guards parity against passing by accident: the test batch sends tokens to every expert, and the
    renormalisation switch moves the logits by far more than the tolerance."""
    ids = token_batch()
    chosen: list[torch.Tensor] = []
    hooks = [
        block.gate.register_forward_hook(lambda m, i, out: chosen.append(out.topk(moe.config.num_experts_per_tok)[1]))
        for block in sparse_layers(moe)
    ]
    logits = moe(ids)
    for h in hooks:
        h.remove()
    for picks in chosen:
        assert picks.unique().numel() == moe.config.num_experts
    flipped = Decoder(replace(moe.config, norm_topk_prob=not moe.config.norm_topk_prob))
    flipped.load_state_dict(moe.state_dict())
    assert max_diff(flipped(ids), logits) > 1e-2


# --- generation ------------------------------------------------------------------------------


def test_engine_greedy_equals_uncached_argmax(moe):
    """Continuous batching over the KV cache (prefill of several lengths, decodes, slots reused) picks the
    tokens the full forward's argmax picks, with the log-probs the trainer's scoring computes."""
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    states = [
        SeqState(uid=i, prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))], seed=i, params=params)
        for i in range(7)
    ]
    Engine(moe, max_batch=3, max_len=32).generate(states)
    with torch.no_grad():
        for s in states:
            ids = torch.tensor([s.prompt_ids + s.output_ids])
            p = len(s.prompt_ids)
            logits = moe(ids)[0]
            assert logits[p - 1 : -1].argmax(-1).tolist() == s.output_ids, s.uid
            score = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
            score[0, p - 1 :] = True
            assert max_diff(torch.tensor(s.logprobs), moe(ids, score=score)) <= TOL, s.uid


# --- training --------------------------------------------------------------------------------


def test_gradients_match_transformers(case, moe):
    """The same loss through both models: router and expert gradients agree (both hold each layer's
    experts as one [E, 2I, H] gate_up and one [E, H, I] down tensor)."""
    reference = hf_model(case)
    model = Decoder(moe.config)
    model.load_state_dict(moe.state_dict())
    ids = token_batch(rows=2, length=12)
    weights = torch.randn(2, 12, VOCAB, generator=torch.Generator().manual_seed(3))
    (model(ids) * weights).sum().backward()
    (reference(input_ids=ids).logits * weights).sum().backward()
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.mlp, SparseMoE):
            continue
        theirs = reference.model.layers[i].mlp
        torch.testing.assert_close(layer.mlp.gate.weight.grad, theirs.gate.weight.grad, rtol=1e-4, atol=1e-4)
        ours = layer.mlp.experts
        torch.testing.assert_close(ours.gate_up_proj.grad, theirs.experts.gate_up_proj.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.down_proj.grad, theirs.experts.down_proj.grad, rtol=1e-4, atol=1e-4)


def test_every_expert_has_a_gradient_even_unchosen(moe):
    """One scored position (the first of two tokens) moves exactly the k experts it is routed to per layer;
    the others still hold a (zero) gradient, as FSDP2's reduce-scatter needs every rank to hold the same
    set of gradients. Checkpointed layers (recomputed in backward, routing included) give the same ones."""
    ids = token_batch(rows=1, length=2)
    score = torch.ones(1, 1, dtype=torch.bool)
    grads = []
    for checkpointing in (False, True):
        model = Decoder(moe.config)
        model.load_state_dict(moe.state_dict())
        model.checkpoint_layers = checkpointing
        model(ids, score=score, temperature=0.7).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
        grads.append({name: p.grad for name, p in model.named_parameters()})
        for block in sparse_layers(model):
            assert block.gate.weight.grad.abs().sum() > 0
            moved = (block.experts.down_proj.grad.abs().sum(dim=(1, 2)) > 0).tolist()
            assert moved == (block.experts.gate_up_proj.grad.abs().sum(dim=(1, 2)) > 0).tolist()
            assert sum(moved) == moe.config.num_experts_per_tok < len(moved)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_grpo_raises_probability_of_rewarded_response(moe):
    model = Decoder(moe.config)
    model.load_state_dict(moe.state_dict())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = GRPOTrainer(model, TrainConfig(lr=3e-3))
    prompt, good, bad = [1, 2, 3], [5, 7], [5, 9]

    def logprobs(response: list[int]) -> list[float]:
        ids = torch.tensor([prompt + response])
        score = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
        score[0, len(prompt) - 1 :] = True
        with torch.no_grad():
            return model(ids, score=score).tolist()

    start_good, start_bad = logprobs(good)[1], logprobs(bad)[1]
    for _ in range(5):
        samples = [
            Sample(
                uid=i,
                prompt_index=0,
                question="",
                reference="",
                prompt_ids=prompt,
                seed=0,
                response_ids=r,
                logprobs=logprobs(r),
            )
            for i, r in enumerate([good, bad, good, bad])
        ]
        trainer.train_batch(samples, [1.0, -1.0, 1.0, -1.0])
    assert logprobs(good)[1] > start_good and logprobs(bad)[1] < start_bad
    for block_name, block in model.named_modules():
        if isinstance(block, SparseMoE):
            name = f"{block_name}.gate.weight"
            assert not torch.equal(dict(model.named_parameters())[name], before[name]), name
