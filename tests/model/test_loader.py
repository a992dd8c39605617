"""A damaged checkpoint is the user's to fix: the loader names the file and what is wrong, as a CheckpointError
(a UserError: one line, exit status 2), never safetensors' or json's own exception."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pivotrl.cli import main
from pivotrl.errors import UserError
from pivotrl.model.loader import CheckpointError, load_model, read_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def policy(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> Path:
    return Path(shutil.copytree(tiny_checkpoints["policy"], tmp_path / "policy"))


def test_a_truncated_weight_file_is_named(policy):
    weights = policy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"^{weights}: cannot be read as safetensors .*damaged or incomplete$"):
        load_model(policy)
    assert issubclass(CheckpointError, UserError) and issubclass(CheckpointError, ValueError)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"architectures": [', "not valid JSON (Expecting value: line 1 column 20)"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"architectures": ["Qwen2ForCausalLM"]}', "no 'num_attention_heads', which the model needs"),
    ],
)
def test_an_invalid_config_json_is_named(policy, text, expected):
    (policy / "config.json").write_text(text)
    with pytest.raises(CheckpointError) as info:
        read_config(policy)
    assert str(info.value) == f"{policy / 'config.json'}: {expected}"


def test_an_invalid_shard_index_is_named(policy):
    (policy / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not valid JSON"):
        load_model(policy)
    (policy / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001.safetensors"}}')
    with pytest.raises(CheckpointError, match="model-00001.safetensors: not found"):
        load_model(policy)


def test_weights_of_another_shape_than_the_config_gives_are_named(policy):
    """A config.json edited (or copied from another size) beside the weights: torch's size-mismatch traceback
    becomes one line naming the weights, their shape and the config's."""
    import json

    cfg = json.loads((policy / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (policy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"weight\(s\) do not have the shape config.json gives them: .*mlp"):
        load_model(policy)


def test_a_tokenizer_file_that_does_not_parse_is_named(policy):
    tok = policy / "tokenizer.json"
    tok.write_text(tok.read_text()[:100])
    with pytest.raises(CheckpointError, match=f"^{tok}: cannot be read as a tokenizer"):
        load_model(policy)


def test_train_with_an_invalid_config_json_exits_2_with_one_line(policy, tiny_checkpoints, tmp_path, capsys):
    (policy / "config.json").write_text('{"architectures": [')
    args = [str(ROOT / "examples/default.yaml"), f"policy.path={policy}", f"judge.path={tiny_checkpoints['judge']}"]
    assert main(["train", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"policy.path: {policy / 'config.json'}: not valid JSON" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
