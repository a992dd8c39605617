"""The job config: defaults, YAML + overrides, and the error a user sees for each kind of mistake."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pivotrl.config import ConfigError, JobConfig, JudgeConfig, LogConfig, _hints, load_config, parse_split


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path: str | Path | None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_defaults_load():
    cfg = load_config(None)
    assert cfg.mode == "colocated" and cfg.steps == 60 and cfg.rollout.group_size == 8
    assert cfg.judge.rewards == {"yes": 1.0, "no": 0.0}
    assert cfg.train.lr == JobConfig().train.lr


def test_relative_paths_resolve_against_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["policy.path=ckpt/p"])
    assert cfg.policy.path == os.path.join(str(tmp_path), "ckpt", "p")
    assert cfg.task.train_file == os.path.join(str(tmp_path), "data", "arithmetic", "train.jsonl")
    assert load_config(None, ["judge.path=/abs/judge"]).judge.path == "/abs/judge"


def test_yaml_and_overrides_merge_with_override_winning(tmp_path):
    path = write(tmp_path, "seed: 3\nsteps: 5\nrollout:\n  group_size: 4\n  top_k: 20\n")
    cfg = load_config(path, ["rollout.group_size=6", "mode=disaggregated", "split=rollout:2,judge:1,train:1"])
    assert (cfg.seed, cfg.steps, cfg.mode) == (3, 5, "disaggregated")
    assert (cfg.rollout.group_size, cfg.rollout.top_k) == (6, 20)
    assert cfg.rollout.prompts_per_step == 32  # untouched fields keep their defaults


def test_float_from_exponent_without_dot(tmp_path):
    # PyYAML reads "1e-4" as a string; a float field still takes it.
    assert load_config(None, ["train.lr=1e-4"]).train.lr == pytest.approx(1e-4)
    assert load_config(write(tmp_path, "train:\n  lr: 3e-5\n")).train.lr == pytest.approx(3e-5)
    assert load_config(None, ["rollout.temperature=2"]).rollout.temperature == 2.0  # int for float is fine


def test_string_override_keeps_raw_text():
    cfg = load_config(
        None, ["task.prompt_template={question} =", "split=", "judge.template=Q:{question}\nA:{response}"]
    )
    assert cfg.task.prompt_template == "{question} ="
    assert cfg.split == ""
    assert cfg.judge.template == "Q:{question}\nA:{response}"
    assert load_config(None, ["judge.template='  A:{response}'"]).judge.template == "  A:{response}"  # quoted: YAML


def test_override_value_that_is_not_yaml():
    assert error_of(None, "rollout.top_k=[1").startswith("override 'rollout.top_k=[1': value is not valid YAML")


def test_override_into_dict_field_extends_the_default():
    assert load_config(None, ["judge.rewards.maybe=0.5"]).judge.rewards == {"yes": 1.0, "no": 0.0, "maybe": 0.5}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollot.group_size=4"], "unknown key 'rollot' (allowed: seed, mode, devices,"),
        (["rollot.group_size=4"], "did you mean 'rollout'?"),
        (["rollout.gruop_size=4"], "unknown key 'rollout.gruop_size'"),
        (["rollout.gruop_size=4"], "did you mean 'group_size'?"),
        (["train.lrr=1e-4"], "did you mean 'lr'?"),
    ],
)
def test_unknown_key_suggests_the_close_one(overrides, expected):
    assert expected in error_of(None, *overrides)


def test_unknown_key_in_yaml_file(tmp_path):
    assert "did you mean 'heldout_file'?" in error_of(write(tmp_path, "task:\n  heldout_fil: x.jsonl\n"))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.group_size=abc", "rollout.group_size: expected an integer, got 'abc'"),
        ("rollout.group_size=true", "rollout.group_size: expected an integer, got True"),
        ("steps=2.5", "steps: expected an integer, got 2.5"),
        ("train.lr=fast", "train.lr: expected a number, got 'fast'"),
        ("train.lr=false", "train.lr: expected a number, got False"),
        ("train.scale_by_std=1", "train.scale_by_std: expected true or false, got 1"),
        ("judge.rewards.yes=high", "judge.rewards.yes: expected a number, got 'high'"),
        ("seed.x=1", "override 'seed.x=1': seed is a value, not a section"),
    ],
)
def test_wrong_type_names_field_and_value(override, expected):
    assert error_of(None, override) == expected


def test_yaml_boolean_trap_is_explained(tmp_path):
    msg = error_of(write(tmp_path, "judge:\n  rewards: {yes: 1.0, no: 0.0}\n"))
    assert msg.startswith("judge.rewards: key True is not a string") and "quote it" in msg


def test_bad_enum():
    assert error_of(None, "mode=foo") == "mode: must be one of colocated, disaggregated, shiftable, got 'foo'"
    assert "policy.dtype: must be one of float32, bfloat16" in error_of(None, "policy.dtype=fp16")
    assert "policy.rollout_dtype: must be one of auto, float32, bfloat16" in error_of(None, "policy.rollout_dtype=fp8")


def test_the_judges_dtype_and_the_backends_are_resolved_by_default():
    """What depends on the devices defaults to auto (the job's plan makes it concrete, ``pivotrl.resolve``)."""
    cfg = load_config(None, [])
    assert (cfg.judge.dtype, cfg.rollout.backend, cfg.judge.backend, cfg.rollout.audit_migrations) == ("auto",) * 4
    assert load_config(None, ["judge.dtype=float16"]).judge.dtype == "float16"  # (GPUs without bfloat16)
    assert error_of(None, "judge.dtype=half") == (
        "judge.dtype: must be one of auto, float32, bfloat16, float16, got 'half'"
    )
    assert error_of(None, "judge.backend=sglang") == "judge.backend: must be one of auto, native, vllm, got 'sglang'"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.group_size=1", "rollout.group_size: expected an integer >= 2, got 1"),
        ("rollout.top_p=0", "rollout.top_p: expected a number in (0, 1], got 0.0"),
        ("rollout.temperature=0", "rollout.temperature: expected a finite number > 0, got 0.0"),
        ("judge.temperature=-1", "judge.temperature: expected a finite number >= 0"),
        ("judge.rewards={}", "judge.rewards: expected a non-empty mapping"),
        ("eval.every=-1", "eval.every: expected an integer >= 0, got -1"),
        ("devices=0", "devices: expected an integer >= 1, got 0"),
        ("train.lr=-1e-4", "train.lr"),  # TrainConfig's own check, still named by its full path
        ("rollout.kv_cache_gb=-1", "rollout.kv_cache_gb: expected a number of GB >= 0 (0 = auto), got -1.0"),
        ("rollout.kv_cache_gb=.inf", "rollout.kv_cache_gb: expected a number of GB >= 0"),
        ("max_staleness=-1", "max_staleness: expected an integer from 0 (on-policy) to 64, got -1"),
        ("max_staleness=65", "max_staleness: expected an integer from 0 (on-policy) to 64, got 65"),
        ("partial_rollout=true", "partial_rollout: needs max_staleness >= 1 (on-policy, no newer version lands"),
        ("train.correction=is", "train.correction: must be one of none, tis, mis, decoupled, got 'is'"),
        ("train.correction_cap=1", "train.correction_cap must be > 1 (an importance weight's bound), got 1.0"),
    ],
)
def test_bad_range_names_full_dotted_path(override, expected):
    assert error_of(None, override).startswith(expected)


def float_keys(cls: type = JobConfig, prefix: str = "") -> Iterator[str]:
    for name, tp in _hints(cls).items():
        if dataclasses.is_dataclass(tp):
            yield from float_keys(tp, f"{prefix}{name}.")
        elif tp is float:
            yield prefix + name


@pytest.mark.parametrize("key", list(float_keys()))
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_every_float_key_refuses_what_is_not_a_finite_number(key, value):
    """No number field means anything by infinity: ``train.lr=.inf`` ran to the end and saved a NaN policy."""
    assert error_of(None, f"{key}={value}").startswith(key)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lr=.inf", "train.lr must be a finite number > 0, got inf"),
        ("train.lr=inf", "train.lr must be a finite number > 0, got inf"),
        ("train.lr=Infinity", "train.lr must be a finite number > 0, got inf"),
        ("train.lr=1e999", "train.lr must be a finite number > 0, got inf"),
        ("train.weight_decay=.inf", "train.weight_decay must be a finite number >= 0, got inf"),
        ("train.eps=.inf", "train.eps must be a finite number > 0, got inf"),
        ("train.kl_coef=.inf", "train.kl_coef must be a finite number >= 0, got inf"),
        ("train.clip_high=.inf", "train.clip_high must be a finite number >= 0, got inf"),
        ("train.clip_low=.inf", "train.clip_low must be a finite number in [0, 1), got inf"),
        ("train.grad_clip=.inf", "train.grad_clip must be a finite number >= 0 (0 disables clipping), got inf"),
        ("judge.temperature=.inf", "judge.temperature: expected a finite number >= 0 (0 = greedy), got inf"),
        ("rollout.temperature=.inf", "rollout.temperature: expected a finite number > 0, got inf"),
        ("device_timeout=.inf", "device_timeout: expected a finite number of seconds > 0, got inf"),
        ("sim.lengths.alpha=.inf", "sim.lengths.alpha: expected a finite number, got inf"),  # (not lognormal's)
    ],
)
def test_infinity_is_named_as_not_finite(override, expected):
    assert error_of(None, override) == expected


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a user's first ``train:`` section (and its lr) was dropped."""
    path = write(tmp_path, "seed: 0\ntrain:\n  lr: 1.0e-4\nsteps: 3\ntrain:\n  grad_clip: 0.5\n")
    assert error_of(path) == f"{path} line 5: key 'train' given twice (first at line 2)"
    path = write(tmp_path, "train:\n  lr: 1.0e-4\n  lr: 2.0e-4\n", "b.yaml")
    assert error_of(path) == f"{path} line 3: key 'lr' given twice (first at line 2)"
    path = write(tmp_path, "judge:\n  rewards: {'yes': 1.0, 'yes': 0.5}\n", "c.yaml")
    assert error_of(path) == f"{path} line 2: key 'yes' given twice (first at line 2)"


def test_a_key_beside_a_merge_key_still_overrides_it(tmp_path):
    path = write(tmp_path, "x-base: &base {lr: 1.0e-4, eps: 1.0e-6}\n", "base.yaml")
    text = path.read_text() + "train:\n  <<: *base\n  lr: 2.0e-4\n"
    with pytest.raises(ConfigError, match="unknown key 'x-base'"):  # (the anchor's own key is not a config key)
        load_config(write(tmp_path, text))
    from pivotrl.config import _UniqueKeyLoader

    assert yaml.load(text, Loader=_UniqueKeyLoader)["train"] == {"lr": 2.0e-4, "eps": 1.0e-6}
    # a mapping that merges another and is itself merged elsewhere first: PyYAML flattens it in place, which
    # must not read as its keys given twice
    nested = "d:\n  base: &base\n    lr: 1.0e-4\n  tuned: &tuned\n    <<: *base\n    lr: 3.0e-4\ntrain:\n  <<: *tuned\n"
    assert yaml.load(nested, Loader=_UniqueKeyLoader) == yaml.safe_load(nested)


@pytest.mark.parametrize(
    ("data", "byte"),
    [("seed: 1\n".encode("utf-16"), "byte 0 is 0xff"), (b"seed: 1\n\x00\x80\xfe binary", "byte 9 is 0x80")],
)
def test_a_file_that_is_not_utf8_is_named(tmp_path, data, byte):
    """UTF-16 as Notepad saves it, or a binary file given as the config: one line, not a UnicodeDecodeError."""
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    assert error_of(path) == f"config file {str(path)!r} is not UTF-8 text ({byte}); save it as UTF-8"


def test_yaml_on_and_off_are_taken_where_a_field_takes_on_and_off(tmp_path):
    """YAML reads ``off`` as false: ``audit_migrations: off`` in a file means what the override says."""
    assert load_config(write(tmp_path, "rollout: {audit_migrations: off}\n")).rollout.audit_migrations == "off"
    assert load_config(write(tmp_path, "rollout: {audit_migrations: on}\n")).rollout.audit_migrations == "on"
    assert load_config(None, ["rollout.audit_migrations=off"]).rollout.audit_migrations == "off"
    msg = error_of(write(tmp_path, "mode: yes\n"))  # elsewhere the boolean is explained
    assert msg.startswith("mode: must be one of colocated, disaggregated, shiftable, got True") and "quote it" in msg


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "seed: 1\ntrain:\n  lr: 1e-4\n bad: [\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: invalid YAML: ") and "line 4" in msg


def test_top_level_must_be_a_mapping(tmp_path):
    assert "expected a mapping" in error_of(write(tmp_path, "- 1\n- 2\n"))


def test_empty_file_and_empty_section_mean_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == load_config(None)
    assert load_config(write(tmp_path, "train:\n", "b.yaml")) == load_config(None)


def test_missing_file():
    assert error_of("no/such/job.yaml") == "config file 'no/such/job.yaml' not found"


@pytest.mark.parametrize("override", ["foo", "=3", "train..lr=1"])
def test_override_without_key_value_shape(override):
    assert error_of(None, override) == f"override {override!r} must look like key=value (e.g. train.lr=1e-4)"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", {}),
        ("rollout:2,judge:1,train:1", {"rollout": 2, "judge": 1, "train": 1}),
        (" rollout : 3 , train:1 ", {"rollout": 3, "train": 1}),
    ],
)
def test_parse_split(spec, expected):
    assert parse_split(spec) == expected


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("rollout2", "split: 'rollout2' must look like role:count"),
        ("rollout:2,", "split: '' must look like role:count"),
        ("rollout:2,critic:1", "split: unknown role 'critic' (allowed: rollout, judge, train)"),
        (
            "rollout:2,genrm:1,train:1",
            "split: unknown role 'genrm' (allowed: rollout, judge, train) (the judge's role is named judge)",
        ),
        ("train:1,train:2", "split: role 'train' given twice"),
        ("judge:0", "split: count of judge must be an integer >= 1, got '0'"),
        ("judge:x", "split: count of judge must be an integer >= 1, got 'x'"),
    ],
)
def test_bad_split(spec, expected):
    with pytest.raises(ConfigError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        parse_split(spec)
    assert error_of(None, f"split={spec}").startswith(expected)


def test_template_with_unknown_field():
    msg = error_of(None, "judge.template=Q:{question} A:{response} {answer}")
    assert msg == (
        "judge.template: unknown field {answer} in 'Q:{question} A:{response} {answer}' "
        "(allowed: {question}, {reference}, {response})"
    )
    assert error_of(None, "judge.template=Q:{question}").startswith("judge.template: must contain {response}")
    assert "literal braces" in error_of(None, "judge.template=A:{response} {")
    assert "task.prompt_template: unknown field {reference}" in error_of(None, "task.prompt_template={reference}")
    assert error_of(None, "task.prompt_template=hi").startswith("task.prompt_template: must contain {question}")


def test_verdict_pattern_needs_one_group():
    assert error_of(None, "judge.verdict_pattern=VERDICT: (?:yes|no)").startswith(
        "judge.verdict_pattern: expected a regex with exactly one capture group (the verdict label), got 0"
    )
    assert "got 2" in error_of(None, "judge.verdict_pattern=(V): (yes|no)")
    assert error_of(None, "judge.verdict_pattern=((").startswith("judge.verdict_pattern: invalid regex")


def test_checks_also_run_when_built_in_python():
    with pytest.raises(ValueError, match="max_new_tokens: expected an integer >= 1, got 0"):
        JudgeConfig(max_new_tokens=0)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(
        None,
        [
            "train.lr=1e-4",
            "mode=shiftable",
            "judge.rewards.maybe=0.25",
            "judge.template=Q:{question}\nA:{response}",
            "rollout.top_p=0.9",
            "train.scale_by_std=false",
        ],
    )
    path = write(tmp_path, yaml.safe_dump(cfg.to_dict()))
    assert load_config(path) == cfg
    assert load_config(None) == load_config(write(tmp_path, yaml.safe_dump(JobConfig().to_dict()), "d.yaml"))


def test_chat_templates_are_off_by_default_and_take_a_system_message():
    cfg = load_config(None)
    assert not cfg.task.chat_template.enabled and cfg.task.chat_template.system is None
    assert not cfg.judge.chat_template.enabled and cfg.judge.chat_template.system is None
    cfg = load_config(
        None,
        [
            "task.chat_template.enabled=true",
            "task.chat_template.system=You are terse: {no fields here}",
            "judge.chat_template.enabled=true",
        ],
    )
    assert cfg.task.chat_template.enabled and cfg.task.chat_template.system == "You are terse: {no fields here}"
    assert cfg.judge.chat_template.enabled and cfg.judge.chat_template.system is None
    assert (
        load_config(
            None, ["judge.chat_template.enabled=true", "judge.chat_template.system="]
        ).judge.chat_template.system
        == ""
    )


def test_chat_template_mistakes():
    assert error_of(None, "task.chat_template.system=Be brief.") == (
        "task.chat_template.system: a system message needs the chat template (enabled is false), got 'Be brief.'"
    )
    assert (
        error_of(None, "judge.chat_template.enabled=maybe")
        == "judge.chat_template.enabled: expected true or false, got 'maybe'"
    )
    assert (
        error_of(None, "judge.chat_template=true")
        == "judge.chat_template: expected a section (mapping of keys), got True"
    )
    assert error_of(None, "task.chat_template.sytem=x").startswith(
        "unknown key 'task.chat_template.sytem' (allowed: enabled, system); did you mean 'system'?"
    )


def test_tracking_is_off_by_default_and_its_keys_are_checked():
    assert load_config(None).log == LogConfig(tensorboard=False, wandb=False, wandb_project="pivotrl")
    assert (LogConfig().wandb_run_name, LogConfig().wandb_mode) == ("", "offline")
    cfg = load_config(None, ["log.wandb=true", "log.wandb_mode=online", "log.wandb_run_name=lr-sweep 3"])
    assert cfg.log.wandb and cfg.log.wandb_mode == "online" and cfg.log.wandb_run_name == "lr-sweep 3"
    assert error_of(None, "log.wandb_mode=cloud") == "log.wandb_mode: must be one of offline, online, got 'cloud'"
    assert error_of(None, "log.wandb_project=team/x") == (
        "log.wandb_project: expected a non-empty name without '/', got 'team/x'"
    )
    assert error_of(None, "log.tensorboard=sometimes") == "log.tensorboard: expected true or false, got 'sometimes'"
    with pytest.raises(ValueError, match="wandb_project: expected a non-empty name"):
        LogConfig(wandb_project=" ")


def test_a_config_a_run_wrote_with_the_judges_old_name_reads_in_todays(tmp_path):
    """The judge's role was once genrm: a run's own config.json (and a checkpoint's) from then still resumes; a
    user's config with the old name fails naming the new one."""
    from pivotrl.config import config_from_dict

    old = JobConfig(mode="disaggregated", devices=4, split="rollout:2,judge:1,train:1").to_dict()
    old["sim"]["genrm_model"] = old["sim"].pop("judge_model")
    old["split"] = "rollout:2,genrm:1,train:1"
    cfg = config_from_dict(old)
    assert cfg.split == "rollout:2,judge:1,train:1" and cfg.sim.judge_model == "Qwen2.5-7B"
    written = tmp_path / "config.json"
    written.write_text(json.dumps(old))
    again = load_config(written, written=True)
    assert (again.split, again.sim) == (cfg.split, cfg.sim)
    with pytest.raises(ConfigError, match="judge_model"):
        load_config(written)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["devices=4", "tensor_parallel=3"], "tensor_parallel: 3 does not divide devices (4): an instance is "
         "tensor_parallel devices; allowed: one of 1, 2, 4, or auto"),
        (["tensor_parallel=0"], "tensor_parallel: expected an integer >= 1, got 0"),
        (["tensor_parallel=two"], "tensor_parallel: must be an integer or auto, got 'two'"),
        (["devices=4", "tensor_parallel=2", "mode=disaggregated", "split=rollout:2,judge:1,train:1"],
         "split: judge:1 is not a whole number of instances of tensor_parallel=2 devices"),
    ],
)  # fmt: skip
def test_an_instance_size_that_does_not_divide_the_job_is_one_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert words in str(e.value)


def test_tensor_parallel_takes_an_integer_or_auto():
    assert load_config(None, ["devices=4", "tensor_parallel=2"]).tensor_parallel == 2
    assert load_config(None, ["tensor_parallel=auto"]).tensor_parallel == "auto"
    assert load_config(None, ["devices=4", "tensor_parallel=2"]).instances(2) == 2


def test_a_simulated_job_holds_its_instance_size_as_sim_instance_gpus(tmp_path):
    """For ``pivotrl simulate`` devices are the instances of sim.gpus and a split counts instances: the size leaves
    the control plane's view (tensor_parallel 1 there) for sim.instance_gpus, its older name, which still loads."""
    job = ["sim.gpus=16", "mode=disaggregated", "split=rollout:2,judge:1,train:1"]  # (devices=1: not read)
    cfg = load_config(None, [*job, "tensor_parallel=4"], simulated=True)
    assert (cfg.tensor_parallel, cfg.sim.instance_gpus, cfg.sim.devices) == (1, 4, 4)
    assert load_config(None, [*job, "sim.instance_gpus=4"], simulated=True) == cfg
    assert load_config(None, ["tensor_parallel=auto"], simulated=True).sim.instance_gpus == "auto"
    both = tmp_path / "both.yaml"
    both.write_text("tensor_parallel: 2\nsim:\n  gpus: 16\n  instance_gpus: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(both, simulated=True)
    assert str(e.value) == (
        "tensor_parallel: 2 and sim.instance_gpus: 4 both name the instance size (sim.instance_gpus is the "
        "simulator's older name for it): give tensor_parallel alone"
    )
    # an override of either name sets the size, later winning; a run's written config names it once, beside 1
    assert load_config(both, ["sim.instance_gpus=8"], simulated=True).sim.instance_gpus == 8
    assert load_config(both, ["tensor_parallel=8"], simulated=True).sim.instance_gpus == 8
    written = tmp_path / "written.yaml"
    written.write_text("tensor_parallel: 1\nsim:\n  gpus: 16\n  instance_gpus: 4\n")
    assert load_config(written, simulated=True).sim.instance_gpus == 4
    with pytest.raises(ConfigError, match=r"^tensor_parallel: expected an integer >= 1, got 0$"):
        load_config(None, ["tensor_parallel=0"], simulated=True)
    with pytest.raises(ConfigError, match="tensor_parallel: must be an integer or auto, got 'two'"):
        load_config(None, ["tensor_parallel=two"], simulated=True)
