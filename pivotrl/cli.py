"""Command line: ``pivotrl train | simulate | prepare | plan | profile | timeline | compare``.

A user's mistake (bad config, missing file, unsupported checkpoint) prints
one line naming what is wrong and what is allowed and exits with status 2;
tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import select
import stat
import sys
from pathlib import Path
from typing import NoReturn

from pivotrl import __version__
from pivotrl.config import ConfigError, JobConfig, load_config, parse_split
from pivotrl.errors import RunInterrupted, UserError
from pivotrl.log import setup_logging

DESCRIPTION = (
    "RL post-training of LLMs with rewards from an LLM judge, on devices that shift between rollout, judge and "
    "training while a step runs."
)
EPILOG = "First run: pivotrl prepare, then pivotrl train examples/default.yaml --out runs/latest (docs/running.md)."
USAGE_ERROR = 2
INTERRUPTED = 3  # the run stopped on a fault it cannot recover from; --resume continues it


def check_inputs(cfg: JobConfig, ray_address: str | None = None) -> None:
    """Fail before any work starts if a file the job needs is missing or unusable, or the device it asks for
    is not here (a cluster's devices are checked once it is joined)."""
    from pivotrl.model import CheckpointError, UnsupportedModelError
    from pivotrl.model.loader import read_config, weight_files
    from pivotrl.runtime.job import check_train_size
    from pivotrl.task.data import read_task

    train, _ = read_task(cfg.task)  # every row, so a bad one is reported before the devices start
    check_train_size(cfg, len(train))
    if cfg.task.checker == "math":
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise UserError("task.checker=math needs the math-verify package (pip install math-verify)") from None
    for field, path in (("policy.path", cfg.policy.path), ("judge.path", cfg.judge.path)):
        if not Path(path).is_dir():
            hint = " (run `pivotrl prepare` to build the bundled models)" if "models" in path else ""
            raise UserError(f"{field}: checkpoint directory {path!r} does not exist{hint}")
        try:
            read_config(path)
            weight_files(Path(path))  # (safetensors: pickled weights are not loaded)
        except (CheckpointError, UnsupportedModelError) as e:
            raise UserError(f"{field}: {e}") from None
    from pivotrl.control.modes import make_policy

    try:
        make_policy(cfg.mode, cfg.devices, parse_split(cfg.split), min_train=max(1, cfg.train.min_devices))
    except ValueError as e:
        raise UserError(str(e)) from None
    if ray_address is None:
        from pivotrl.runtime import devices

        devices.resolve(cfg.device, devices.local_gpus())


def check_directory(option: str, path: Path, purpose: str) -> None:
    """``path`` is a directory or can become one: neither it nor a folder above it is a file."""
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            where = "" if p == path else f" ({p} is a file)"
            raise UserError(f"{option} {path}: not a directory{where}; name a directory {purpose}")


def check_run_dir(out: Path, resumable: bool) -> None:
    """``--out`` of a new run, before anything starts: a directory that can be made, holding no run. A new run
    there would truncate the old one's metrics and leave its checkpoints for a later ``--resume`` to mix in."""
    from pivotrl.telemetry import run_files

    check_directory("--out", out, "for the run")
    found = run_files(out)
    if found:
        again = f", continue it with `pivotrl train --resume {out}`" if resumable and "config.json" in found else ""
        names = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise UserError(
            f"--out {out}: already holds a run ({names}), which this one would overwrite; give a new --out{again}, "
            "or remove it first"
        )
    made = [p for p in (out, *out.parents) if not p.exists()]  # (deepest first)
    try:  # made and removed again: a failed start leaves nothing behind
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the directory ({e.strerror})") from None
    for path in made:
        path.rmdir()


def check_resume_overrides(run: Path, overrides: list[str]) -> None:
    """A resume continues the run as it was configured: only how it is operated may change (``OPERATIONAL``)."""
    from pivotrl.runtime.job import OPERATIONAL

    for override in overrides:
        key = override.partition("=")[0].strip()
        if "=" in override and key.split(".")[0] not in OPERATIONAL:
            raise UserError(
                f"--resume {run}: {override} would change what the run computes; a resume continues with the run's "
                f"own config ({run / 'config.json'}) and takes overrides of {', '.join(OPERATIONAL)} only (to train "
                f"on, start a new run from its policy: policy.path={run / 'policy'} --out NEW_DIR)"
            )


def cmd_train(args: argparse.Namespace) -> int:
    if args.ray_address:  # before anything imports ray, which reads RAY_AUTH_MODE once
        from pivotrl.runtime.devices import enable_cluster_token

        enable_cluster_token()
    if args.resume:  # the run's own config; one given as well must be the same (run_job says what differs)
        out = Path(args.resume)
        if args.out and Path(args.out).resolve() != out.resolve():
            raise UserError(f"--resume continues the run in place: --out {args.out} names another directory")
        saved = out / "config.json"
        if not saved.is_file():
            raise UserError(f"--resume {out}: not a run directory (no config.json)")
        config, overrides = args.config, list(args.overrides)
        if config is not None and "=" in config and not Path(config).is_file():  # (`--resume RUN key=value`)
            config, overrides = None, [config, *overrides]
        check_resume_overrides(out, overrides)
        cfg = load_config(config or saved, overrides, written=config is None)
    else:
        if not args.config or not args.out:
            raise UserError("train needs a CONFIG and --out DIR (or --resume RUN_DIR)")
        out, cfg = Path(args.out), load_config(args.config, args.overrides)
        check_run_dir(out, resumable=True)
    check_inputs(cfg, args.ray_address)
    from pivotrl.runtime.job import run_job

    summary = run_job(cfg, out, progress=not args.quiet, ray_address=args.ray_address, resume=bool(args.resume))
    print(format_summary(summary, out))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pivotrl.sim.run import format_sim, format_sizes, run_simulation

    if args.versus is None and (args.sizes or args.search_budget is not None or args.seeds is not None):
        raise UserError("--sizes, --search-budget and --seeds go with --versus (the job in several modes side by side)")
    if args.versus is not None:
        return _simulate_versus(args)
    cfg = load_config(args.config, args.overrides, simulated=True)
    out = Path(args.out)
    check_run_dir(out, resumable=False)
    summary = run_simulation(cfg, out, progress=not args.quiet)
    print(format_summary(summary, out))
    print(format_sim(summary))
    if not args.quiet:  # (the other sizes' floors: a few tenths of a second more)
        hint = format_sizes(cfg)
        if hint:
            print(hint)
    return 0


def _simulate_versus(args: argparse.Namespace) -> int:
    from pivotrl.sim.versus import format_versus, versus

    out = Path(args.out)
    check_run_dir(out, resumable=False)
    say = (lambda _: None) if args.quiet else (lambda line: print(line, flush=True))  # noqa: E731
    given = {k: v for k, v in (("search_budget", args.search_budget), ("seeds", args.seeds)) if v is not None}
    report = versus(args.config, args.overrides, out, args.versus, args.sizes or (), say=say, **given)
    print(format_versus(report))
    print(f"runs written to {out}/<mode>, the table to {out / 'versus.json'}")
    return 2 if any("error" in r for r in report["modes"].values()) else 0  # (a mode asked for did not run)


def format_summary(s: dict, out: Path) -> str:
    """The few lines a person reads at the end of a run; the rest is in summary.json."""
    shift = s["shift_seconds"]
    ran = s["steps"] - s.get("resumed_from_step", 0)  # (a resumed run's rates are of the steps it ran)
    steady = f" ({s['steady_samples_per_s']:.0f} after the first step)" if ran > 1 else ""
    return "\n".join(
        [
            f"{s['mode']} on {s['devices']} device(s), {s['steps']} steps",
            f"held-out accuracy {s['accuracy_start']:.3f} -> {s['accuracy_end']:.3f} ({s['accuracy_gain']:+.3f}); "
            f"judge agreement {s['judge_agreement']:.4f}, {s['judge_parse_failures']} unparsable verdicts",
            f"{s['samples_per_s']:.0f} samples/s{steady}; "
            f"{s['shifts']} shifts (mean {shift['mean'] * 1000:.0f} ms, max {shift['max'] * 1000:.0f} ms), "
            f"{s['migrations']} migrations",
            f"timeline: {out / 'timeline.png'}   trace: {out / 'trace.json'} (open in Perfetto)",
            f"run written to {out}",
        ]
    )


def cmd_prepare(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pivotrl.recipes.prepare import prepare

    bars: dict[str, tqdm] = {}

    def progress(name: str, step: int, total: int, loss: float) -> None:
        if name not in bars:
            bars[name] = tqdm(total=total, desc=f"prepare {name}", unit="step", disable=args.quiet)
        bars[name].update(1)
        bars[name].set_postfix(loss=f"{loss:.3f}")
        if step == total:
            bars[name].close()

    check_directory("--models", Path(args.models), "for the models")
    check_directory("--data", Path(args.data), "for the task data")
    built = prepare(args.models, args.data, seed=args.seed, force=args.force, progress=progress)
    for name, path in built.items():
        print(f"{name}: {path}")
    return 0


def _instances(run: Path) -> dict[int, int] | None:
    """Each device's instance as the run placed them (its summary's), where instances were of several devices."""
    try:
        placed = json.loads((run / "summary.json").read_text()).get("instances")
        return {int(d): int(i) for d, i in placed.items()} if placed else None
    except (OSError, ValueError, AttributeError, TypeError):  # (no summary yet, or not one: rows named by device)
        return None


def cmd_timeline(args: argparse.Namespace) -> int:
    from pivotrl.telemetry import PICTURE_FORMATS, draw_timeline, read_events, read_jsonl, step_spans

    run = Path(args.run_dir)
    out = Path(args.out) if args.out else run / "timeline.png"
    if out.suffix.lstrip(".").lower() not in PICTURE_FORMATS:
        got = f"a {out.suffix} file" if out.suffix else "no suffix"
        allowed = ", ".join(f".{f}" for f in PICTURE_FORMATS)
        raise UserError(f"--out {out}: {got}; the picture's format is its suffix, one of {allowed}")
    slices = read_events(run)
    metrics = run / "metrics.jsonl"  # (overlapping steps' spans: lanes above the devices)
    steps = step_spans([row for _, row in read_jsonl(metrics)]) if metrics.is_file() else []
    draw_timeline(slices, out, title=run.name, instances=_instances(run), steps=steps)
    print(out)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pivotrl.plan import format_report, plan_report

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.profile) if args.profile else None
    if run_dir is not None and not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"--profile: {str(run_dir)!r} is not a run directory (no metrics.jsonl)")
    if args.device_memory_gb is not None and not 0 < args.device_memory_gb < math.inf:
        raise UserError(
            f"--device-memory-gb: got {args.device_memory_gb:g}, must be a finite number > 0 (a train device's memory)"
        )
    report = plan_report(cfg, run_dir, device_gb=args.device_memory_gb, gpu=args.gpu)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from pivotrl.sim.measured import fit_run, replay_overrides, write_length_trace

    try:
        fit = fit_run(args.run_dir)
    except ValueError as e:
        raise UserError(str(e)) from None
    fit.costs.save(args.out)
    for m in (fit.costs.rollout, fit.costs.genrm):
        line = f"{m.step_base_s * 1e3:.2f} ms + {m.step_per_seq_s * 1e6:.1f} us/sequence"
        kv, prefill = m.step_per_kv_token_s * 1e9, m.prefill_per_token_s * 1e6
        print(f"{m.model}: decode step {line} + {kv:.0f} ns/KV token, prefill {prefill:.1f} us/token")
    t = fit.costs.train
    print(f"train: {t.per_token_s * 1e6:.1f} us/token + {t.per_call_s * 1e3:.1f} ms/call, "
          f"optimizer step {t.optimizer_step_s * 1e3:.1f} ms")  # fmt: skip
    replay = " ".join(replay_overrides(args.run_dir, fit))
    trace = Path(args.out).with_suffix(".lengths.jsonl")
    if write_length_trace(args.run_dir, trace):  # (each sample's own length, as the run generated it)
        replay += f" sim.lengths_file={trace} sim.lengths_replay=true"
    config = Path(args.run_dir) / "config.json"
    print(f"measured costs written to {args.out}; the run's job on them: pivotrl simulate {config} "
          f"sim.costs={args.out} {replay} --out DIR")  # fmt: skip
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from pivotrl.compare import compare_runs, format_comparison

    c = compare_runs(args.run_a, args.run_b)
    print(json.dumps(c.to_dict(), indent=2) if args.json else format_comparison(c, args.run_a, args.run_b))
    return 0


def _versus_modes(value: str) -> tuple[str, ...]:
    """``--versus``'s modes, from the comma-separated form ``_versus_argv`` gives them (empty: the on-policy
    ones; the overlapping ones, ``-k1`` and ``-k2``, when named)."""
    from pivotrl.sim.versus import MODES, SYNC_MODES

    modes = tuple(m for m in value.split(",") if m)
    for m in modes:
        if m not in MODES:
            raise argparse.ArgumentTypeError(f"invalid mode {m!r} (choose from {', '.join(MODES)})")
    return modes or SYNC_MODES


def _versus_argv(argv: list[str]) -> list[str]:
    """``simulate --versus`` takes the bare words after it (its modes) and nothing else, so that overrides
    and the config may follow: ``--versus colocated shiftable sim.gpus=16`` is read as
    ``--versus=colocated,shiftable sim.gpus=16``, ``--versus job.yaml`` as ``--versus= job.yaml``."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] != "--versus":
            out.append(argv[i])
            i += 1
            continue
        j = i + 1
        while j < len(argv) and argv[j].replace("_", "").isalpha():  # (a path or an override is not a bare word)
            j += 1
        out.append("--versus=" + ",".join(argv[i + 1 : j]))
        i = j
    return out


class _CommandParser(argparse.ArgumentParser):
    """A command's parser: its positional arguments (a config, ``key=value`` overrides) may come before, between
    or after its options, as in ``pivotrl train CONFIG --out DIR steps=1``."""

    _intermixed = False

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 (argparse's signature)
        if self._intermixed:  # (parse_known_intermixed_args parses through here, twice)
            return super().parse_known_args(args, namespace)
        self._intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixed = False

    def error(self, message: str) -> NoReturn:
        # (the intermixed parse names every positional it found missing, ``overrides`` too, which may be empty)
        message = message.replace("arguments are required: config, overrides", "argument is required: config")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pivotrl", description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"pivotrl {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    t = sub.add_parser("train", help="run an RL job")
    t.add_argument("config", nargs="?", help="job config (YAML), e.g. examples/default.yaml")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=1e-4 steps=10")
    t.add_argument("--out", help="run directory to write")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its newest usable checkpoint, in place")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--ray-address", help="join this Ray cluster (e.g. 'auto') instead of starting a local one")
    t.set_defaults(func=cmd_train)
    si = sub.add_parser("simulate", help="run a job's control plane against modeled GPUs on a virtual clock")
    si.add_argument("config", help="job config (YAML); sim.* says what is modeled, e.g. examples/sim128.yaml")
    si.add_argument("overrides", nargs="*", help="key=value overrides, e.g. sim.gpus=1024 steps=20")
    si.add_argument("--out", required=True, help="run directory to write")
    si.add_argument("--quiet", action="store_true", help="no progress bar")
    si.add_argument("--versus", type=_versus_modes, metavar="MODE ...",
                    help="run the job in each of these modes (none named: deployed colocated disaggregated "
                    "shiftable) and print them side by side, with shiftable's speedups")  # fmt: skip
    si.add_argument("--sizes", nargs="+", type=int, metavar="GPUS",
                    help="with --versus: GPUs an instance to try, each mode kept at its fastest")  # fmt: skip
    si.add_argument("--search-budget", type=int, metavar="RUNS",
                    help="with --versus: runs of the static split's search per size (default 12), where the "
                    "job names no split")  # fmt: skip
    si.add_argument(
        "--seeds",
        type=int,
        metavar="N",
        help="with --versus: runs of each mode (the job's seed and the N - 1 after it), averaged",
    )
    si.set_defaults(func=cmd_simulate)
    pr = sub.add_parser("prepare", help="build the bundled task data, policy and judge (CPU, minutes)")
    pr.add_argument("--models", default="models", help="where to write the model directories")
    pr.add_argument("--data", default="data/arithmetic", help="where the task data lives")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--force", action="store_true", help="rebuild even if up to date")
    pr.add_argument("--quiet", action="store_true")
    pr.set_defaults(func=cmd_prepare)
    pl = sub.add_parser("plan", help="recommended start split and expected step timeline, without running")
    pl.add_argument("config")
    pl.add_argument("overrides", nargs="*")
    pl.add_argument("--profile", help="a finished run directory whose measured lengths and throughputs to use")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--device-memory-gb", type=float, help="a device's memory: the fewest train devices each "
                    "trainer fits on (train.min_devices), the devices an instance needs (tensor_parallel)")  # fmt: skip
    pl.add_argument("--gpu", help="the modeled GPU the step is priced on, one of pivotrl.sim's (H100, H800, H200, "
                    "A100; default: the one --device-memory-gb suggests, H100 for 80); alone, its memory is the "
                    "devices'")  # fmt: skip
    pl.set_defaults(func=cmd_plan)
    tl = sub.add_parser("timeline", help="redraw a run's timeline picture from its events.jsonl")
    tl.add_argument("run_dir")
    tl.add_argument("--out", help="picture path (default RUN_DIR/timeline.png); its suffix names the format: "
                    ".png, .pdf, .svg, ...")  # fmt: skip
    tl.set_defaults(func=cmd_timeline)
    pf = sub.add_parser("profile", help="fit a measured-costs file (sim.costs) to a finished run's events")
    pf.add_argument("run_dir", help="a run directory of `pivotrl train`")
    pf.add_argument("--out", required=True, help="measured-costs JSON file to write")
    pf.set_defaults(func=cmd_profile)
    cp = sub.add_parser("compare", help="compare two runs of one job: samples, rewards, held-out accuracy")
    cp.add_argument("run_a")
    cp.add_argument("run_b")
    cp.add_argument("--json", action="store_true")
    cp.set_defaults(func=cmd_compare)
    return p


PATH_OPTIONS = ("out", "resume", "data", "models", "profile")  # the options that name a path
PATH_ARGUMENTS = ("config", "run_dir", "run_a", "run_b")  # and the positional arguments


# the OS errors a path the user gave can cause, theirs to fix (others on such a path are a bug's, in full)
USER_PATH_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOENT", "EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "ENOTDIR", "EISDIR",
                                      "EEXIST", "ENAMETOOLONG", "ELOOP") if hasattr(errno, name)
)  # fmt: skip


def path_error(e: OSError, args: argparse.Namespace) -> str | None:
    """An OS error on a path the user gave (or one under it), as one line naming the option; None for others
    (a file not found is the user's whatever its path: their config or run directory named it)."""
    if e.filename is not None and e.errno in USER_PATH_ERRNOS:
        failed = os.path.abspath(os.fsdecode(e.filename))
        for dest in PATH_OPTIONS + PATH_ARGUMENTS:
            given = getattr(args, dest, None)
            if not isinstance(given, str):
                continue
            root = os.path.abspath(given)
            if failed == root or failed.startswith(root.rstrip(os.sep) + os.sep):
                label = f"--{dest} {given}" if dest in PATH_OPTIONS else given
                under = "" if failed == root else f" ({os.fsdecode(e.filename)})"
                return f"{label}: {e.strerror or e}{under}"
    return str(e) if isinstance(e, FileNotFoundError) else None


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader went away (Linux reports the write end as in error then)."""
    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # (no real stdout, or no poll on this platform)
        return True  # (then the pipe error is most likely stdout's, as before)


def _quiet_stdout() -> None:
    """The reader of stdout went away (``pivotrl ... | head``): what is still buffered goes nowhere, as a Unix
    tool's output does, instead of failing again when Python flushes it at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _resume_hint(args: argparse.Namespace | None) -> str:
    """How to continue a train run stopped by Ctrl-C, where it has a checkpoint (the job module is loaded once
    the run is started: before, it wrote none)."""
    job = sys.modules.get("pivotrl.runtime.job")
    out = None if args is None or args.command != "train" else args.resume or args.out
    if job is None or not out:
        return ""
    from pivotrl import checkpoint as ckpt  # (loaded with the job module)

    return f"; {job.resume_hint(out)}" if ckpt.has_checkpoint(out) else ""


BROKEN_PIPE = 128 + 13  # the status of a Unix tool killed by SIGPIPE


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = None
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        if argv[:1] == ["simulate"]:
            argv = _versus_argv(argv)
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:  # (--help, a usage error: what it printed is flushed here, a closed pipe seen)
            sys.stdout.flush()
            raise
        status = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is seen here
        return status
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe (an engine's, a tracker's): a failure, reported in full
        _quiet_stdout()
        return BROKEN_PIPE
    except (ConfigError, UserError) as e:
        print(f"pivotrl: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as e:
        line = path_error(e, args)
        if line is None:
            raise  # not about a path the user gave: a bug's, reported in full
        print(f"pivotrl: error: {line}", file=sys.stderr)
        return USAGE_ERROR
    except RunInterrupted as e:
        print(f"pivotrl: stopped: {e}", file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:
        print(f"pivotrl: interrupted{_resume_hint(args)}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
