import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples/default.yaml")


@pytest.mark.parametrize(
    "args, message",
    [
        ([CONFIG, "rollot.group_size=4"], "unknown key 'rollot'"),
        ([CONFIG, "train.lr=abc"], "train.lr: expected a number, got 'abc'"),
        ([CONFIG, "train.lr=-1"], "train.lr must be > 0"),
        ([CONFIG, "mode=sideways"], "mode: must be one of colocated, disaggregated, shiftable"),
        ([CONFIG, "steps"], "override 'steps' must look like key=value"),
        (["missing.yaml"], "config file 'missing.yaml' not found"),
        ([CONFIG, "policy.path=/nonexistent/policy"], "policy.path: checkpoint directory '/nonexistent/policy'"),
        ([CONFIG, "task.train_file=/nonexistent.jsonl"], "task.train_file: '/nonexistent.jsonl' not found"),
    ],
)
def test_user_mistakes_exit_2_with_one_clear_line(args, message, capsys, tmp_path):
    assert main(["train", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing written, nothing lost


def test_a_trainer_that_would_round_its_weights_is_refused(tmp_path, capsys, tiny_checkpoints):
    """train.backend=zero computes from the weights the rollout runs: fp32 compute from bf16 ones is one line."""
    models = [f"policy.path={tiny_checkpoints['policy']}", f"judge.path={tiny_checkpoints['judge']}"]
    zero = ["train.backend=zero", "train.precision=fp32", "policy.rollout_dtype=bfloat16"]
    args = ["train", CONFIG, *models, *zero, "--out", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "train.backend=zero computes in float32 from the weights the rollout runs (bfloat16)" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_invalid_yaml_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n")
    assert main(["train", str(bad), "--out", str(tmp_path / "run")]) == 2
    assert "invalid YAML" in capsys.readouterr().err


def test_unsupported_checkpoint_is_a_user_error(tmp_path, capsys, tiny_checkpoints):
    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    args = ["train", CONFIG, f"policy.path={ckpt}", f"judge.path={tiny_checkpoints['judge']}", "--out", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel" in err and "Qwen2ForCausalLM" in err


def test_real_process_exit_status_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pivotrl.cli", "train", CONFIG, "rollout.group_size=1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "rollout.group_size: expected an integer >= 2, got 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_prints_a_start_split_and_timeline(capsys, tmp_path):
    assert main(["plan", CONFIG, "devices=4"]) == 0
    out = capsys.readouterr().out
    assert "recommended start split: rollout:" in out and "step" in out
    assert main(["plan", CONFIG, "devices=4", "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert sum(report["recommended"].values()) == 4 and report["estimates"]
    assert main(["plan", CONFIG, "--profile", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_unreachable_ray_address_is_a_user_error(capsys, tmp_path, tiny_checkpoints):
    args = [f"policy.path={tiny_checkpoints['policy']}", f"judge.path={tiny_checkpoints['judge']}", "devices=2"]
    out = tmp_path / "run"
    assert main(["train", CONFIG, *args, "--ray-address", "127.0.0.1:1", "--out", str(out)]) == 2
    assert "--ray-address 127.0.0.1:1: nothing answers there" in capsys.readouterr().err
    assert not out.exists()


def test_run_summary_lines_name_the_outputs():
    from pivotrl.cli import format_summary

    s = {"mode": "colocated", "devices": 1, "steps": 3, "accuracy_start": 0.59, "accuracy_end": 0.7,
         "accuracy_gain": 0.11, "judge_agreement": 0.999, "judge_parse_failures": 2, "samples_per_s": 300.0,
         "steady_samples_per_s": 320.0, "shifts": 9, "shift_seconds": {"mean": 0.012, "max": 0.03},
         "migrations": 0}  # fmt: skip
    text = format_summary(s, Path("runs/latest"))
    assert "0.590 -> 0.700 (+0.110)" in text and "2 unparsable verdicts" in text
    assert "9 shifts (mean 12 ms, max 30 ms), 0 migrations" in text
    assert "runs/latest/timeline.png" in text and "runs/latest/trace.json" in text


@pytest.mark.parametrize(
    "layout, message",
    [
        (["mode=disaggregated", "devices=4", "split=rollout:2,judge:1,train:1"], "split: train:1 is fewer than the 2"),
        (["devices=1"], "train.min_devices: the optimizer step needs 2 devices, but the job has 1"),
    ],
)
def test_fewer_train_devices_than_the_step_needs_are_refused(layout, message, tmp_path, capsys, tiny_checkpoints):
    models = [f"policy.path={tiny_checkpoints['policy']}", f"judge.path={tiny_checkpoints['judge']}"]
    args = ["train", CONFIG, *models, *layout, "train.min_devices=2", "--out", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def write_qwen7b_config(where: Path) -> Path:
    """A checkpoint folder holding only Qwen2.5-7B's config.json (enough for what reads no weights)."""
    import json

    from tests.train.test_memory import QWEN2_5_7B as c

    policy = where / "qwen7b"
    policy.mkdir()
    policy.joinpath("config.json").write_text(json.dumps({
        "architectures": [c.architecture], "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
    }))  # fmt: skip
    return policy


def test_plan_says_how_many_train_devices_the_policy_needs(tmp_path, capsys):
    """Qwen2.5-7B's config.json alone (plan reads no weights): on 80 GB devices FSDP2 needs 3 at the step, ZeRO-1
    6, a replica fits none; in bf16, 16384-token micro batches, activation checkpointing on. Marked: the trainer
    train.backend=auto takes for the job."""
    import json

    policy = write_qwen7b_config(tmp_path)
    args = [CONFIG, f"policy.path={policy}", "devices=8", "train.activation_checkpointing=true"]
    assert main(["plan", *args, "--device-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "7.62B parameters, bf16 compute, 16384-token micro batches, activation checkpointing on" in out
    assert "fewest train devices that fit 80 GB: fsdp 3, zero 6, replicated none of 8" in out
    # (shiftable mode, the example's: train.backend=auto takes ZeRO-1 where it fits, FSDP2 in the static modes)
    assert "-> train.min_devices=auto takes 6 on such devices (zero)" in out
    assert main(["plan", *args, "mode=disaggregated", "--device-memory-gb", "80"]) == 0
    assert "-> train.min_devices=auto takes 3 on such devices (fsdp)" in capsys.readouterr().out
    assert main(["plan", CONFIG, f"policy.path={policy}", "devices=8", "--device-memory-gb", "80"]) == 0
    assert "activation checkpointing on (auto, for these devices)" in capsys.readouterr().out
    assert main(["plan", CONFIG, f"policy.path={policy}", "devices=8"]) == 0
    assert (
        "activation checkpointing off (auto: decided for the devices a run finds; --device-memory-gb)"
        in capsys.readouterr().out
    )
    assert main(["plan", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["train_memory"]
    assert report["worlds"] == [1, 2, 4, 8] and "fewest_devices" not in report
    assert main(["plan", CONFIG, "policy.path=/nonexistent"]) == 0  # the rest of the plan still prints
    assert "train memory: not estimated, policy.path: cannot read '/nonexistent/config.json'" in capsys.readouterr().out
    assert main(["plan", *args, "--device-memory-gb", "0"]) == 2
    assert "--device-memory-gb: got 0, must be a finite number > 0" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "simulate"])
def test_an_out_directory_holding_a_run_is_refused_and_left_as_it_was(command, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main([command, CONFIG, "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"--out {run}: already holds a run (config.json, metrics.jsonl)" in err and "Traceback" not in err
    assert "give a new --out" in err and "or remove it first" in err
    assert (f"pivotrl train --resume {run}" in err) == (command == "train")
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl"]
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_an_empty_or_new_out_directory_is_taken_and_nothing_is_made_before_the_run(tmp_path):
    from pivotrl.cli import check_run_dir

    empty = tmp_path / "empty"
    empty.mkdir()
    check_run_dir(empty, resumable=True)
    check_run_dir(tmp_path / "new" / "run", resumable=True)
    assert empty.is_dir() and not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "out, message",
    [
        ("file", "--out {tmp}/file: not a directory; name a directory for the run"),
        ("file/run", "--out {tmp}/file/run: not a directory ({tmp}/file is a file)"),
        ("/proc/nope", "--out /proc/nope: cannot create the directory ("),
    ],
)
@pytest.mark.parametrize("command", ["train", "simulate"])
def test_an_out_that_cannot_be_a_directory_is_refused_up_front(command, out, message, tmp_path, capsys):
    (tmp_path / "file").write_text("kept\n")
    out = out if out.startswith("/") else str(tmp_path / out)
    assert main([command, CONFIG, "--out", out]) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err
    assert (tmp_path / "file").read_text() == "kept\n"


def test_an_os_error_on_a_path_the_user_gave_names_the_option(tmp_path, capsys):
    from pivotrl.telemetry import RunWriter, Slice

    RunWriter(tmp_path).write_events([Slice(0, "rollout", "r", 0.0, 1.0)])
    out = tmp_path / "missing" / "t.png"
    assert main(["timeline", str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: No such file or directory" in err and "Traceback" not in err


def test_a_checkpoint_with_pickled_weights_only_is_refused_before_the_run(tmp_path, capsys, tiny_checkpoints):
    policy = tmp_path / "policy"
    shutil.copytree(tiny_checkpoints["policy"], policy)
    (policy / "model.safetensors").rename(policy / "pytorch_model.bin")
    args = ["train", CONFIG, f"policy.path={policy}", f"judge.path={tiny_checkpoints['judge']}"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"policy.path: {policy}: only pickled weights (*.bin/*.pt) found; pivotrl loads safetensors only" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_weights_that_do_not_load_are_a_user_error(tmp_path, capsys, tiny_checkpoints):
    """Found only when the job loads them: one line, exit 2, nothing written."""
    policy = tmp_path / "policy"
    shutil.copytree(tiny_checkpoints["policy"], policy)
    shutil.copy(tiny_checkpoints["judge"] / "config.json", policy / "config.json")  # Llama's names, Qwen2's biases
    models = [f"policy.path={policy}", f"judge.path={tiny_checkpoints['judge']}", "mode=colocated", "devices=1"]
    assert main(["train", CONFIG, *models, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"pivotrl: error: {policy}: weights do not match LlamaForCausalLM" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_fewer_train_problems_than_a_step_draws_are_refused(tmp_path, capsys, tiny_checkpoints):
    train = tmp_path / "train.jsonl"
    train.write_text("".join((ROOT / "data/arithmetic/train.jsonl").read_text().splitlines(keepends=True)[:3]))
    models = [f"policy.path={tiny_checkpoints['policy']}", f"judge.path={tiny_checkpoints['judge']}"]
    args = ["train", CONFIG, *models, f"task.train_file={train}", "rollout.prompts_per_step=4"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"rollout.prompts_per_step=4: task.train_file {train} holds only 3 problems" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("option", ["--data", "--models"])
def test_prepare_into_a_file_is_refused(option, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("kept\n")
    assert main(["prepare", option, str(file)]) == 2
    err = capsys.readouterr().err
    assert f"{option} {file}: not a directory" in err and "Traceback" not in err
    assert file.read_text() == "kept\n"


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`pivotrl ... | head`: no traceback, the status of a Unix tool its reader left (SIGPIPE's)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pivotrl.cli", "plan", CONFIG, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    proc.stdout.close()  # the reader is gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""


def test_a_pipe_other_than_stdout_breaking_is_a_failure_reported_in_full(monkeypatch, capfd):
    """Only stdout's reader going away is the quiet exit 141; a broken pipe elsewhere (an engine's, a tracker's)
    while stdout is open is a failure, and a traceback says where."""
    import pivotrl.cli as cli

    def broken(args):
        raise BrokenPipeError("the engine's pipe")

    monkeypatch.setattr(cli, "cmd_plan", broken)
    with pytest.raises(BrokenPipeError, match="the engine's pipe"):
        main(["plan", CONFIG])


@pytest.mark.parametrize(
    "args",
    [
        ["train", CONFIG, "--out", "{out}", "rollot.group_size=4"],
        ["train", "--quiet", CONFIG, "--out", "{out}", "steps=2", "rollot.group_size=4"],
        ["simulate", CONFIG, "--quiet", "rollot.group_size=4", "--out", "{out}"],
        ["plan", CONFIG, "--json", "rollot.group_size=4"],
    ],
)
def test_overrides_are_taken_after_options(args, tmp_path, capsys):
    """Read as overrides wherever they stand: the typo is reported as the config's, not as an unknown argument."""
    assert main([a.format(out=tmp_path / "run") for a in args]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'rollot'" in err and "unrecognized arguments" not in err
    assert not (tmp_path / "run").exists()


def test_plan_takes_an_override_after_json(capsys):
    import json

    assert main(["plan", CONFIG, "--json", "devices=3"]) == 0
    assert sum(json.loads(capsys.readouterr().out)["recommended"].values()) == 3


def resumable_run(where: Path, ckpt: dict[str, Path]) -> Path:
    """A run directory as far as its config: the job's config.json, no checkpoint yet."""
    import json

    from pivotrl.config import load_config

    run = where / "run"
    run.mkdir()
    cfg = load_config(CONFIG, [f"policy.path={ckpt['policy']}", f"judge.path={ckpt['judge']}", "devices=1"])
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    return run


@pytest.mark.parametrize("override", ["steps=12", "train.lr=1e-3"])
def test_a_resume_refuses_overrides_of_what_the_run_computes(override, tmp_path, capsys, tiny_checkpoints):
    run = resumable_run(tmp_path, tiny_checkpoints)
    assert main(["train", "--resume", str(run), override]) == 2
    err = capsys.readouterr().err
    assert f"--resume {run}: {override} would change what the run computes" in err
    assert f"run's own config ({run / 'config.json'})" in err and f"policy.path={run / 'policy'}" in err
    assert "Traceback" not in err and sorted(p.name for p in run.iterdir()) == ["config.json"]


def test_a_resume_takes_overrides_of_how_the_run_is_operated(tmp_path, capsys, tiny_checkpoints):
    run = resumable_run(tmp_path, tiny_checkpoints)
    assert main(["train", "--resume", str(run), "checkpoint.keep=3", "--quiet"]) == 2
    assert "no usable checkpoint" in capsys.readouterr().err  # (past the overrides: this run has none)


@pytest.mark.parametrize("checkpointed", [True, False])
def test_ctrl_c_says_how_to_resume_a_run_with_a_checkpoint(
    checkpointed, tmp_path, capsys, monkeypatch, tiny_checkpoints
):
    from pivotrl.runtime import job

    run = tmp_path / "run"

    def interrupted(cfg, out, **kwargs) -> None:
        if checkpointed:
            (Path(out) / "checkpoints" / "step_000002").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "run_job", interrupted)
    models = [f"policy.path={tiny_checkpoints['policy']}", f"judge.path={tiny_checkpoints['judge']}", "devices=1"]
    assert main(["train", CONFIG, *models, "--out", str(run)]) == 130
    err = capsys.readouterr().err
    hint = f"pivotrl: interrupted; resume with: pivotrl train --resume {run} (newest checkpoint: step_000002)"
    assert (hint in err) == checkpointed and "pivotrl: interrupted" in err and "Traceback" not in err


@pytest.mark.parametrize("steps, resumed_from, steady", [(3, None, True), (1, None, False), (10, 9, False)])
def test_the_rate_after_the_first_step_is_shown_only_when_there_were_later_steps(steps, resumed_from, steady):
    from pivotrl.cli import format_summary

    s = {"mode": "colocated", "devices": 1, "steps": steps, "accuracy_start": 0.5, "accuracy_end": 0.5,
         "accuracy_gain": 0.0, "judge_agreement": 1.0, "judge_parse_failures": 0, "samples_per_s": 75.0,
         "steady_samples_per_s": 78.0, "shifts": 4, "shift_seconds": {"mean": 0.01, "max": 0.02},
         "migrations": 0}  # fmt: skip
    if resumed_from is not None:
        s["resumed_from_step"] = resumed_from
    text = format_summary(s, Path("runs/latest"))
    assert ("75 samples/s (78 after the first step); 4 shifts" in text) == steady
    assert ("75 samples/s; 4 shifts" in text) != steady


def test_help_says_what_pivotrl_is_and_version_names_the_package(capsys):
    import pivotrl

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "RL post-training of LLMs" in out and "``" not in out
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"pivotrl {pivotrl.__version__}\n"


def test_only_path_errors_the_user_can_fix_are_usage_errors(tmp_path):
    """A full disk or a missing file under --out is the user's to fix (one line, exit 2); an I/O error there
    is not theirs, and is reported in full."""
    import argparse
    import errno

    from pivotrl.cli import path_error

    args = argparse.Namespace(out=str(tmp_path))
    under = str(tmp_path / "checkpoints" / "x")
    assert path_error(OSError(errno.ENOSPC, "No space left on device", under), args) == (
        f"--out {tmp_path}: No space left on device ({under})"
    )
    assert path_error(OSError(errno.EIO, "Input/output error", under), args) is None


def test_a_missing_config_is_named_alone(capsys):
    """Overrides are optional: a command without its config says only that the config is missing."""
    with pytest.raises(SystemExit) as info:
        main(["plan"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "the following argument is required: config" in err and "overrides" not in err.splitlines()[-1]
