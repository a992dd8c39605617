"""The control plane and the simulator import neither torch, Ray nor numpy: the
simulator runs the control plane unchanged, in plain Python. Nor do they import
the task's libraries (math-verify, pyarrow): the task reaches the controller as
plain functions and problems."""

import subprocess
import sys

import pytest

CONTROL_PLANE = [
    "pivotrl.control.controller",
    "pivotrl.control.book",
    "pivotrl.control.dispatch",
    "pivotrl.control.evaluation",
    "pivotrl.control.fleet",
    "pivotrl.control.live",
    "pivotrl.control.metrics",
    "pivotrl.control.recovery",
    "pivotrl.control.remaining",
    "pivotrl.control.spec",
    "pivotrl.control.training",
    "pivotrl.control.scheduler",
    "pivotrl.control.modes",
    "pivotrl.control.planner",
    "pivotrl.control.profiles",
    "pivotrl.control.shiftable",
    "pivotrl.control.messages",
    "pivotrl.control.drive",
    "pivotrl.config",
    "pivotrl.reward.genrm",
    "pivotrl.sample",
    "pivotrl.train.advantages",
]
SIMULATOR = [
    "pivotrl.sim",
    "pivotrl.sim.hardware",
    "pivotrl.sim.models",
    "pivotrl.sim.costs",
    "pivotrl.sim.measured",
    "pivotrl.sim.workload",
    "pivotrl.sim.config",
    "pivotrl.sim.engine",
    "pivotrl.sim.synthetic",
    "pivotrl.sim.driver",
    "pivotrl.sim.run",
    "pivotrl.summary",
    "pivotrl.resolve",  # (the simulator and `pivotrl plan` resolve jobs too)
    "pivotrl.train.traits",
    "pivotrl.train.memory",  # (the simulator sizes the trainer's memory: activation checkpointing where needed)
    "pivotrl.model.config",
]

PROBE = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in sys.argv[1].split(","):
            raise ImportError(f"imported {name}")
        return None

sys.meta_path.insert(0, Blocked())
import importlib
for mod in sys.argv[2:]:
    importlib.import_module(mod)
print("ok")
"""


def probe(*modules: str, blocked: str = "torch,ray,numpy") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, blocked, *modules], capture_output=True, text=True)


@pytest.mark.parametrize("modules", [CONTROL_PLANE, SIMULATOR], ids=["control-plane", "simulator"])
def test_imports_neither_torch_nor_ray_nor_numpy(modules):
    proc = probe(*modules)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_the_probe_does_catch_torch():
    proc = probe("pivotrl.model.decoder")
    assert proc.returncode != 0 and "imported torch" in proc.stderr


def test_the_control_plane_reaches_the_task_through_plain_functions():
    """The checkers and the data readers import math-verify and pyarrow only when they run."""
    modules = [*CONTROL_PLANE, "pivotrl.task.checkers", "pivotrl.task.data", "pivotrl.task.arithmetic"]
    proc = probe(*modules, blocked="torch,ray,numpy,math_verify,pyarrow,datasets,sympy")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
