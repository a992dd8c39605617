"""Policy training: GRPO loss, advantages and the gradient-accumulating trainer.

``TrainConfig`` lives in a torch-free module; the torch parts are imported
from ``pivotrl.train.grpo`` by the code that runs them.
"""

from pivotrl.train.config import TrainConfig

__all__ = ["TrainConfig"]
