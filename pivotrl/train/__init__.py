"""Policy training: the GRPO loss, the trainers behind one protocol, and what the rest of the system reads of them.

Torch-free, for the control plane, the resolver and the simulator: ``config`` (``TrainConfig``), ``traits``
(the trainers by kind and their traits), ``memory`` (what a train device holds), ``advantages``, ``protocol``
(the ``Trainer`` interface, ``StepResult``, ``TrainSetup``). Torch, imported by the code that runs them: ``loss``
(the GRPO loss and its backward), ``grpo`` (AdamW over a replica), ``group`` (a train group and its
collectives), the trainers ``replicated``, ``fsdp`` and ``zero`` (with ``shards``, what the sharded two share),
and ``registry``, which builds a trainer by its kind.
"""

from pivotrl.train.config import TrainConfig

__all__ = ["TrainConfig"]
