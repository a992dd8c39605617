"""Against a real Ray cluster started as a user starts one: ``ray start --head`` in a fresh environment.

The cluster declares 4 GPUs on this CPU machine (``--num-gpus 4``), so the GPU-placement path runs for
real: placement group, GPU shares, CUDA_VISIBLE_DEVICES; torch sees no CUDA there, so under
``device=auto`` the devices compute on the CPU (see ``pivotrl.runtime.devices``). The environment has no
RAY_* variable and its own HOME (a token there, as any earlier local ``ray.init`` leaves one: ``ray start``
then turns token auth on) and TMPDIR (where ``ray start`` records the running cluster, as it does in /tmp
for a user). Nothing is exported by hand. The cluster is stopped by signalling its ``--block`` process,
never by ``ray stop``, which would stop every Ray instance on the machine.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples/default.yaml")
RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class Cluster:
    address: str
    env: dict[str, str]  # the fresh environment it was started in; a user's shell beside it
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("home")
    tmp = Path(tempfile.mkdtemp(prefix="pvr-", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home), "TMPDIR": str(tmp)}
    subprocess.run([RAY, "get-auth-token", "--generate"], env=env, capture_output=True, check=True, timeout=60)
    port, log = free_port(), home / "head.log"
    args = ["--port", str(port), "--num-cpus", "4", "--num-gpus", "4"]
    with open(log, "w") as out:
        head = subprocess.Popen(
            [RAY, "start", "--head", "--block", *args, "--include-dashboard=false", "--disable-usage-stats"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 90
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None, f"ray start --head failed:\n{log.read_text()}"
            assert time.time() < deadline, f"ray start --head did not come up in 90 s:\n{log.read_text()}"
            time.sleep(0.5)
        yield Cluster(f"127.0.0.1:{port}", env, log)
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its cluster on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def train(
    cluster: Cluster, ckpt: dict[str, Path], out: Path, *extra: str, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``pivotrl train`` on a tiny job in a process of its own, from the cluster's fresh environment."""
    job = [
        f"policy.path={ckpt['policy']}",
        f"judge.path={ckpt['judge']}",
        "mode=colocated",
        "devices=2",
        "steps=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.max_batch=4",
        "judge.max_new_tokens=8",
        "eval.size=4",
        "eval.every=0",
        "eval.max_new_tokens=8",
    ]
    cmd = [sys.executable, "-m", "pivotrl.cli", "train", CONFIG, *job, *extra, "--quiet", "--out", str(out)]
    return subprocess.run(cmd, env=cluster.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_joins_a_token_auth_cluster_with_nothing_exported(cluster, tiny_checkpoints, tmp_path):
    assert "Token authentication is enabled" in cluster.log.read_text()
    run = train(cluster, tiny_checkpoints, tmp_path / "run", "--ray-address", cluster.address)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["devices"] == 2 and summary["steps"] == 1
    # each device in its own bundle with a GPU of its own; 4 declared CPUs shared by 2 devices: 2 threads each
    held = re.findall(r"device (\d): cpu on [\d.]+, bundle (\d), GPU (\d+), (\d+) threads", run.stderr)
    assert [(d, b) for d, b, _, _ in held] == [("0", "0"), ("1", "1")]
    assert len({gpu for _, _, gpu, _ in held}) == 2
    assert [t for _, _, _, t in held] == ["2", "2"]


def test_local_run_starts_its_own_instance_beside_a_running_cluster(cluster, tiny_checkpoints, tmp_path):
    """The cluster is the one a bare ``ray.init()`` would join (TMPDIR holds its address); a local run must not."""
    run = train(cluster, tiny_checkpoints, tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()
    # its own instance declares no GPU (the cluster declares 4): no device holds one
    assert run.stderr.count(", GPU -, ") == 2


def test_cuda_on_gpus_torch_cannot_use_is_one_line_and_exit_2(cluster, tiny_checkpoints, tmp_path):
    run = train(cluster, tiny_checkpoints, tmp_path / "run", "device=cuda", "--ray-address", cluster.address)
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.startswith("pivotrl: error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr
    assert re.search(r"device=cuda: device 0 on node [\d.]+ holds GPU \d but its torch sees no CUDA", errors[0])
    assert not (tmp_path / "run").exists()


BIND = """
import dataclasses, json, sys
import ray
from pivotrl.config import JobConfig
from pivotrl.errors import UserError
from pivotrl.runtime.contexts import ContextSpec
from pivotrl.runtime.ray_driver import RayDriver

out = {}
for devices, share, backend in ((4, 1.0, "native"), (4, 0.5, "native"), (5, 1.0, "native"), (2, 1.0, "vllm")):
    try:
        cfg, kinds = JobConfig(devices=devices, gpus_per_device=share), []
        backends = dict(rollout=dataclasses.replace(cfg.rollout, backend=backend),
                        judge=dataclasses.replace(cfg.judge, backend=backend))
        cfg = dataclasses.replace(cfg, **backends)
        driver = RayDriver(cfg, lambda kind: kinds.append(kind) or ContextSpec(device=kind), 0.0, sys.argv[1])
    except UserError as e:
        out[f"{devices}x{share}{backend}"] = str(e)
        continue
    pg = driver.bindings[0].placement_group
    total, free = ray.cluster_resources(), ray.available_resources()
    names = [f"GPU_group_{d}_{pg}" for d in range(devices)]  # how Ray names a bundle's GPU share
    out[f"{devices}x{share}{backend}"] = {
        "bindings": [dataclasses.asdict(b) for b in driver.bindings],
        "bundle_gpu": [[total.get(n), free.get(n, 0.0)] for n in names],
        "node_ips": [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]],
        "spec_for": kinds,
    }
    driver.close()
print(json.dumps(out))
"""


def test_device_actors_hold_their_own_bundle_and_gpu_share(cluster):
    run = subprocess.run(
        [sys.executable, "-c", BIND, cluster.address], env=cluster.env, cwd=ROOT, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    whole, halves = out["4x1.0native"], out["4x0.5native"]
    for case, share in ((whole, 1.0), (halves, 0.5)):
        b = case["bindings"]
        assert [x["device"] for x in b] == [x["bundle"] for x in b] == [0, 1, 2, 3]
        assert len({x["placement_group"] for x in b}) == 1
        assert all(x["cuda_visible_devices"] == ",".join(x["gpu_ids"]) for x in b)  # Ray shows each its own GPU
        assert all(x["node_ip"] == case["node_ips"][0] and x["kind"] == "cpu" and x["threads"] == 1 for x in b)
        assert all(x["memory_bytes"] == 0 for x in b)  # (a GPU its torch cannot use: no memory to plan with)
        assert case["bundle_gpu"] == [[share, 0.0]] * 4  # each bundle reserves its share, taken by its actor
        # the devices' spec is built for the kind the cluster has (its dtypes, shared GPUs and trainer follow)
        assert case["spec_for"] == ["cuda"]
    assert sorted(x["gpu_ids"][0] for x in whole["bindings"]) == ["0", "1", "2", "3"]  # one GPU each
    assert max(Counter(x["gpu_ids"][0] for x in halves["bindings"]).values()) <= 2  # at most two halves a GPU
    # policy and judge on vLLM: each device's bundle holds its GPU share for three processes (its own and its two
    # engines', started once the plan says so), the device's taking a third
    engines = out["2x1.0vllm"]
    assert engines["bundle_gpu"] == [[1.0, 0.6667]] * 2
    assert out["5x1.0native"] == (
        f"devices=5, gpus_per_device=1: the Ray cluster at {cluster.address} has 4 CPU, 4 GPU, "
        "the devices need 5 CPU, 5 GPU; lower devices or gpus_per_device"
    )
