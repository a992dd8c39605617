"""The control plane imports neither torch nor Ray: the simulator runs it unchanged."""

import subprocess
import sys

CONTROL_PLANE = [
    "pivotrl.control.controller",
    "pivotrl.control.scheduler",
    "pivotrl.control.modes",
    "pivotrl.control.planner",
    "pivotrl.control.messages",
    "pivotrl.config",
    "pivotrl.reward.genrm",
    "pivotrl.sample",
    "pivotrl.train.advantages",
]

PROBE = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "ray"):
            raise ImportError(f"control plane imported {name}")
        return None

sys.meta_path.insert(0, Blocked())
import importlib
for mod in sys.argv[1:]:
    importlib.import_module(mod)
print("ok")
"""


def test_control_plane_imports_neither_torch_nor_ray():
    proc = subprocess.run([sys.executable, "-c", PROBE, *CONTROL_PLANE], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_the_probe_does_catch_torch():
    proc = subprocess.run([sys.executable, "-c", PROBE, "pivotrl.model"], capture_output=True, text=True)
    assert proc.returncode != 0 and "control plane imported torch" in proc.stderr
