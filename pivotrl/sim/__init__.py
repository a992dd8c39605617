"""The simulator's data: modeled GPUs, model shapes, cost models and workloads.

Pure standard-library Python (no torch, Ray or numpy), so that a simulator
driver can run the unchanged control plane against thousands of modeled
devices on a virtual clock in seconds: ``driver`` (with ``engine``, a modeled
continuous-batching engine, and ``synthetic``, stand-in texts) does, and
``run`` makes a run directory of it (``pivotrl simulate``, ``sim.*`` keys in
``config``).
"""

from pivotrl.sim.costs import CostModel, DeployedCosts, RooflineCosts, ScaledCosts, StepTime, max_batch, steps_within
from pivotrl.sim.hardware import GPU, GPUS
from pivotrl.sim.measured import GenMeasure, MeasuredCosts, TrainMeasure
from pivotrl.sim.models import MODELS, ModelSpec, get_model
from pivotrl.sim.workload import LengthDist, LengthKind, SimWorkload

__all__ = [
    "GPU",
    "GPUS",
    "MODELS",
    "CostModel",
    "DeployedCosts",
    "GenMeasure",
    "LengthDist",
    "LengthKind",
    "MeasuredCosts",
    "ModelSpec",
    "RooflineCosts",
    "ScaledCosts",
    "SimWorkload",
    "StepTime",
    "TrainMeasure",
    "get_model",
    "max_batch",
    "steps_within",
]
