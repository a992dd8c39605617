"""What a device is and where it sits: the pure rules, case by case, and the config keys that feed them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl.cli import main
from pivotrl.config import ConfigError, load_config
from pivotrl.errors import UserError
from pivotrl.runtime import devices as dev

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples/default.yaml")


@pytest.mark.parametrize(
    "requested, gpus, kind",
    [
        pytest.param("auto", 0, "cpu", id="auto-no-gpu"),
        pytest.param("auto", 8, "cuda", id="auto-gpus"),
        pytest.param("auto", 0.5, "cuda", id="auto-half-a-declared-gpu"),
        pytest.param("cuda", 1, "cuda", id="cuda-gpu"),
        pytest.param("cpu", 8, "cpu", id="cpu-despite-gpus"),
        pytest.param("cpu", 0, "cpu", id="cpu-no-gpu"),
    ],
)
def test_resolve(requested, gpus, kind):
    assert dev.resolve(requested, gpus) == kind


def test_resolve_cuda_without_gpus_names_the_key_and_the_place():
    with pytest.raises(UserError, match=r"device=cuda: the Ray cluster at h:1 has no CUDA GPU; use device=auto"):
        dev.resolve("cuda", 0, "the Ray cluster at h:1")


@pytest.mark.parametrize(
    "kind, devices, share, expected",
    [
        pytest.param("cuda", 2, 1.0, [{"CPU": 1, "GPU": 1.0}] * 2, id="one-gpu-each"),
        pytest.param("cuda", 4, 0.25, [{"CPU": 1, "GPU": 0.25}] * 4, id="four-share-one-gpu"),
        pytest.param("cpu", 3, 1.0, [{"CPU": 1}] * 3, id="cpu-whole-cores-no-gpu"),
    ],
)
def test_bundles(kind, devices, share, expected):
    assert dev.bundles(kind, devices, share) == expected


@pytest.mark.parametrize(
    "kind, devices, share, total, short",
    [
        pytest.param("cuda", 4, 1.0, {"CPU": 8, "GPU": 4}, {}, id="fits-exactly"),
        pytest.param("cuda", 5, 1.0, {"CPU": 8, "GPU": 4}, {"GPU": 5}, id="one-gpu-short"),
        pytest.param("cuda", 8, 0.5, {"CPU": 8, "GPU": 4}, {}, id="halves-fit"),
        pytest.param("cuda", 3, 1 / 3, {"CPU": 4, "GPU": 1}, {}, id="thirds-round-off"),
        pytest.param("cuda", 2, 1.0, {"CPU": 8}, {"GPU": 2}, id="no-gpu-at-all"),
        pytest.param("cpu", 5, 1.0, {"CPU": 4, "GPU": 4}, {"CPU": 5}, id="cpu-short"),
    ],
)
def test_shortfall(kind, devices, share, total, short):
    assert dev.shortfall(dev.bundles(kind, devices, share), total) == pytest.approx(short)


@pytest.mark.parametrize(
    "nodes, cores, per_device, threads",
    [
        pytest.param(["a"], {"a": 2}, 0, [2], id="one-device-takes-the-machine"),
        pytest.param(["a"] * 4, {"a": 2}, 0, [1] * 4, id="more-devices-than-cores-at-least-one"),
        pytest.param(["a"] * 3, {"a": 8}, 0, [2] * 3, id="rounded-down"),
        pytest.param(["a", "a", "b"], {"a": 16, "b": 16}, 0, [8, 8, 16], id="per-node"),
        pytest.param(["a"] * 4, {"a": 2}, 3, [3] * 4, id="set-by-key"),
        pytest.param(["x"], {}, 0, [1], id="unknown-node"),
    ],
)
def test_thread_shares(nodes, cores, per_device, threads):
    assert dev.thread_shares(nodes, cores, per_device) == threads


def binding(d: int, kind: str) -> dev.Binding:
    return dev.Binding(d, d, "pg", "10.0.0.1", (str(d),), str(d), kind, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "requested, wanted, kinds, error",
    [
        pytest.param("cuda", "cuda", ["cuda", "cuda"], None, id="cuda-everywhere"),
        pytest.param("cuda", "cuda", ["cuda", "cpu"], "device=cuda: device 1 on node 10.0.0.1", id="one-blind"),
        pytest.param("auto", "cuda", ["cpu", "cpu"], None, id="auto-falls-back"),
        pytest.param("cpu", "cpu", ["cpu"], None, id="cpu"),
    ],
)  # fmt: skip
def test_check_bindings(requested, wanted, kinds, error):
    bindings = [binding(d, k) for d, k in enumerate(kinds)]
    if error is None:
        dev.check_bindings(requested, wanted, bindings)
    else:
        with pytest.raises(UserError, match=error):
            dev.check_bindings(requested, wanted, bindings)


def test_node_address_outside_ray_is_loopback():
    code = "from pivotrl.runtime.devices import node_address; print(node_address())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "127.0.0.1"


def test_device_keys_defaults_and_mistakes():
    cfg = load_config(CONFIG)
    assert (cfg.device, cfg.gpus_per_device, cfg.threads_per_device) == ("auto", 1.0, 0)
    cfg = load_config(CONFIG, ["device=cpu", "gpus_per_device=0.25", "threads_per_device=3"])
    assert (cfg.device, cfg.gpus_per_device, cfg.threads_per_device) == ("cpu", 0.25, 3)
    for item, message in [
        ("device=gpu", "device: must be one of auto, cuda, cpu, got 'gpu'"),
        ("gpus_per_device=0", "gpus_per_device: expected a number in (0, 1]"),
        ("gpus_per_device=1.5", "gpus_per_device: expected a number in (0, 1]"),
        ("threads_per_device=-1", "threads_per_device: expected an integer >= 0, got -1"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(CONFIG, [item])
        assert message in str(e.value), item


@pytest.mark.skipif(dev.local_gpus() > 0, reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line_and_exit_2(tiny_checkpoints, tmp_path, capsys):
    ckpt = [f"policy.path={tiny_checkpoints['policy']}", f"judge.path={tiny_checkpoints['judge']}"]
    assert main(["train", CONFIG, *ckpt, "device=cuda", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == "pivotrl: error: device=cuda: this machine has no CUDA GPU; use device=auto or device=cpu\n"
    assert not (tmp_path / "run").exists()


TOKEN_PROBE = """
import os, sys
if sys.argv[1] == "ray-first":
    import ray  # noqa: F401
from pivotrl.runtime.devices import enable_cluster_token
on = enable_cluster_token()
mode = None
if "ray" in sys.modules:
    from ray._raylet import AuthenticationMode, get_authentication_mode
    mode = get_authentication_mode() == AuthenticationMode.TOKEN
print(on, os.environ.get("RAY_AUTH_MODE"), mode)
"""


@pytest.mark.parametrize(
    "token, env, order, expected",
    [
        pytest.param(False, {}, "ours-first", "False None None", id="no-token-no-auth"),
        pytest.param(True, {}, "ours-first", "True token None", id="token-file"),
        pytest.param(False, {"RAY_AUTH_TOKEN": "t" * 32}, "ours-first", "True token None", id="token-in-env"),
        pytest.param(True, {"RAY_AUTH_MODE": "disabled"}, "ours-first", "False disabled None", id="mode-set-wins"),
        pytest.param(True, {}, "ray-first", "True token True", id="ray-imported-first-refreshed"),
    ],
)
def test_cluster_token(token, env, order, expected, tmp_path):
    """Ray reads RAY_AUTH_MODE once, at import; each case runs in a fresh process with its own HOME."""
    if token:
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("x" * 32)
    fresh = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path), **env}
    out = subprocess.run(
        [sys.executable, "-c", TOKEN_PROBE, order], capture_output=True, text=True, env=fresh, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def test_cli_imports_no_ray_before_it_sets_the_token():
    """The CLI enables the cluster token first thing in ``train``; nothing before may have imported ray."""
    code = (
        "import sys; import pivotrl.cli; from pivotrl.config import load_config; import pivotrl.runtime.devices;"
        f"load_config({CONFIG!r}); print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
