"""Peak memory per train device of the sharded trainers (FSDP2, ZeRO-1), at 1, 2 and 4 train devices, on CPU.

Each world size runs in fresh processes (gloo on loopback), one per device:
a ~100M-parameter Qwen2-shaped policy, fp32 master weights and AdamW state,
activation checkpointing, one GRPO step over the same batch (each rank gets
its share). A device's peak is the growth of its process's resident-set
high-water mark from just before the model is built to just after the
optimizer step: parameters, gradients, optimizer state, activations,
gathered layers and allocator slack, all of it (Python and torch themselves
are left out). The exact bytes of the sharded state are printed beside it.

glibc's malloc is pinned to a fixed mmap threshold in these processes:
its adaptive threshold otherwise keeps freed blocks of up to 32 MB in
per-thread arenas (gloo's threads each have one), which measured here as
~1 GB of high-water mark that no tensor holds, at every world size. On a GPU
the CUDA caching allocator manages device memory and this does not apply.

The ZeRO-1 trainer (``train.backend=zero``) is measured the same way: each
rank backpropagates its share alone first (as it would while the rollout
runs), then meets the others for the step. It holds the compute-dtype weights
and an fp32 gradient sum whole, and 1/W of the master weights and AdamW
state: in fp32 compute, as here, 8 + 12/W bytes a parameter against FSDP2's
16/W; with bf16 compute on a GPU, 6 + 12/W.

It also prints the same accounting for Qwen2.5-7B on 8 x 80 GB as
arithmetic (nothing of that size runs here).

    python benchmarks/train_memory.py [--worlds 1 2 4] [--backends fsdp zero] [--out ...train_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pivotrl.model import Decoder, ModelConfig  # noqa: E402
from pivotrl.sample import Sample  # noqa: E402
from pivotrl.train import memory  # noqa: E402
from pivotrl.train.config import TrainConfig  # noqa: E402
from pivotrl.train.fsdp import ShardedTrainer  # noqa: E402
from pivotrl.train.group import TrainGroup  # noqa: E402
from pivotrl.train.zero import ZeroTrainer  # noqa: E402

SAMPLES, PROMPT, RESPONSE = 8, 64, 192  # one step's batch: 8 sequences of 256 tokens


def model_config() -> ModelConfig:
    """Qwen2-shaped, ~100M parameters: 12 layers of width 768, GQA 12:2, a 16k vocabulary, untied head."""
    return ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=16384,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=64,
        qkv_bias=True,
        tie_word_embeddings=False,
    )


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def batch(vocab: int) -> tuple[list[Sample], list[float]]:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for uid in range(SAMPLES):
        ids = torch.randint(1, vocab, (PROMPT + RESPONSE,), generator=gen).tolist()
        lp = (-torch.rand(RESPONSE, generator=gen) * 5).tolist()
        samples.append(Sample(uid, uid // 4, "", "", ids[:PROMPT], 0, response_ids=ids[PROMPT:], logprobs=lp))
    return samples, [1.0, -1.0] * (SAMPLES // 2)


def _rank(rank: int, world: int, port: int, out: str, backend: str) -> None:
    torch.set_num_threads(1)
    group = TrainGroup.join(rank, world, master_port=port, device="cpu", process_group=True)
    cfg = TrainConfig(micro_batch=2, micro_batch_tokens=MICRO_TOKENS, activation_checkpointing=True)
    config = model_config()
    samples, adv = batch(config.vocab_size)
    mine = [i for i in range(SAMPLES) if i % world == rank]
    before = peak_rss()
    if backend == "fsdp":
        trainer = ShardedTrainer(group, config, cfg, 1.0, 0)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.to_local().normal_(0.0, 0.02)
        trainer.add([samples[i] for i in mine], [adv[i] for i in mine])
        start = time.perf_counter()
        trainer.step()
        local = sum(p.to_local().numel() for p in trainer.model.parameters())
        state = {"param_bytes": local * 4, "grad_bytes": local * 4, "optimizer_bytes": local * 8}
    else:
        model = Decoder.empty(config, "cpu", torch.float32)
        model.checkpoint_layers = True
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        trainer = ZeroTrainer(model, cfg, 1.0, 0)
        start = time.perf_counter()
        trainer.accumulate([samples[i] for i in mine], [adv[i] for i in mine])  # alone, before the group meets
        trainer.bind(group)
        trainer.load_weights(None)
        trainer.step()
        whole = trainer.numel
        local = trainer.master.numel()
        state = {"param_bytes": whole * 4 + local * 4, "grad_bytes": whole * 4, "optimizer_bytes": local * 8}
    seconds = time.perf_counter() - start
    peak = peak_rss() - before
    row = {"rank": rank, "peak_bytes": peak, **state, "step_seconds": seconds}
    Path(out, f"{world}.{rank}.json").write_text(json.dumps(row))
    group.leave()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MICRO_TOKENS = 512  # train.micro_batch_tokens of the measured runs (two 256-token sequences)


def measure(world: int, backend: str = "fsdp") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(world, free_port(), tmp, backend), nprocs=world, join=True)
        rows = [json.loads(Path(tmp, f"{world}.{r}.json").read_text()) for r in range(world)]
    worst = max(rows, key=lambda r: r["peak_bytes"])
    state = worst["param_bytes"] + worst["grad_bytes"] + worst["optimizer_bytes"]
    return {
        "world_size": world,
        "peak_bytes_per_device": worst["peak_bytes"],
        "state_bytes_per_device": state,
        "activations_and_slack_bytes": worst["peak_bytes"] - state,
        # what pivotrl.train.memory says of it (fp32 compute, checkpointed)
        "predicted_bytes_per_device": memory.per_device(model_config(), backend, world, MICRO_TOKENS, 4, True),
        "step_seconds": max(r["step_seconds"] for r in rows),
        "ranks": rows,
    }


QWEN2_5_7B = ModelConfig(  # Qwen/Qwen2.5-7B's config.json: 7.62e9 parameters
    architecture="Qwen2ForCausalLM",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    head_dim=128,
    qkv_bias=True,
    tie_word_embeddings=False,
)
TOKENS_7B = 8192  # one micro batch (train.micro_batch_tokens) of the 7B accounting, activation checkpointing on


def qwen7b_arithmetic(world: int = 8, gpu_gb: float = 80.0) -> dict:
    """Qwen2.5-7B with bf16 compute on ``world`` devices of ``gpu_gb``, by trainer (``pivotrl.train.memory``)."""
    out: dict = {"world_size": world, "gpu_bytes": gpu_gb * 1e9, "parameters": QWEN2_5_7B.num_parameters(),
                 "micro_batch_tokens": TOKENS_7B}  # fmt: skip
    acts = memory.activation_bytes(QWEN2_5_7B, TOKENS_7B, 2, checkpointed=True)
    for trainer in memory.TRAINERS:
        pieces = {**memory.state_bytes(QWEN2_5_7B, trainer, world, 2), **acts}
        fewest = memory.fewest_devices(QWEN2_5_7B, trainer, gpu_gb * 1e9, 64, TOKENS_7B, 2, checkpointed=True)
        out[trainer] = {"per_device": pieces, "total_per_device": sum(pieces.values()), "fewest_devices": fewest}
    return out


def _table(rows: list[dict]) -> None:
    base = rows[0]["peak_bytes_per_device"]
    head = f"{'devices':>8} {'peak MB':>9} {'state MB':>9} {'rest MB':>8} {'vs 1':>6} {'step s':>7}"
    print(f"{head} {'predicted MB':>13}")
    for r in rows:
        peak, state, rest, predicted = (r[k] / 1e6 for k in ("peak_bytes_per_device", "state_bytes_per_device",
                                                              "activations_and_slack_bytes",
                                                              "predicted_bytes_per_device"))  # fmt: skip
        ratio = r["peak_bytes_per_device"] / base
        print(
            f"{r['world_size']:>8} {peak:>9.0f} {state:>9.0f} {rest:>8.0f} {ratio:>6.2f} {r['step_seconds']:>7.1f} "
            f"{predicted:>13.0f}"
        )


def _series(rows: list[dict]) -> dict:
    base = rows[0]["peak_bytes_per_device"]
    return {
        "world_sizes": [r["world_size"] for r in rows],
        "peak_bytes_per_device": [r["peak_bytes_per_device"] for r in rows],
        "ratio_vs_one_device": [r["peak_bytes_per_device"] / base for r in rows],
        "runs": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--backends", nargs="+", choices=("fsdp", "zero"), default=["fsdp", "zero"])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/train_memory.json"))
    args = p.parse_args()
    params = model_config().num_parameters()
    result: dict = {"where": "CPU, gloo, one process per device", "parameters": params}
    for backend in args.backends:
        name = {"fsdp": "FSDP2", "zero": "ZeRO-1 (train.backend=zero)"}[backend]
        print(f"train memory per device, {params / 1e6:.0f}M-parameter Qwen2-shaped policy, {name} on CPU (gloo), "
              "fp32 compute, master weights and AdamW, activation checkpointing")  # fmt: skip
        rows = [measure(w, backend) for w in args.worlds]
        _table(rows)
        print()
        if backend == "fsdp":  # the top-level series: FSDP2's
            result |= _series(rows)
        else:
            result["zero"] = _series(rows)
    q = qwen7b_arithmetic()
    print(f"Qwen2.5-7B on 8 x 80 GB, bf16 compute, {TOKENS_7B}-token micro batches, activation checkpointing "
          "(arithmetic, not measured; pivotrl.train.memory):")  # fmt: skip
    for trainer in memory.TRAINERS:
        t = q[trainer]
        print(f"  {trainer}: {t['total_per_device'] / 1e9:.1f} GB a device at 8; the fewest 80 GB devices it fits on: "
              f"{t['fewest_devices'] or 'none'}")  # fmt: skip
        for k, v in t["per_device"].items():
            print(f"    {k:<50} {v / 1e9:6.1f} GB")
    result["qwen2_5_7b_arithmetic"] = q
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # read by glibc when each rank's process starts
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    sys.exit(main())
