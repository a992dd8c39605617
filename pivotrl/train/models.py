"""The models a trainer builds from the GPS: the policy from a version's snapshot, and the frozen reference."""

from __future__ import annotations

import torch

from pivotrl.gps import Snapshot
from pivotrl.model import Decoder, ModelConfig
from pivotrl.train.protocol import TrainSetup


def decoder(snap: Snapshot, device: torch.device, dtype: torch.dtype) -> Decoder:
    """The model of a GPS snapshot (its architecture in the snapshot's meta), its weights copied onto ``device``."""
    model = Decoder.empty(ModelConfig.from_hf(snap.manifest.meta["config"]), device, dtype)
    snap.load_into(model)
    return model.eval()


def policy_models(setup: TrainSetup, dtype: torch.dtype) -> tuple[Decoder, Decoder | None, int]:
    """The policy to train in ``dtype``, the frozen reference policy where the loss has a KL term, and the bytes
    read from the GPS for them."""
    model = decoder(setup.weights, setup.device, dtype)
    model.checkpoint_layers = setup.cfg.activation_checkpointing
    model.requires_grad_(True)
    nbytes = setup.weights.nbytes
    ref = None
    if setup.cfg.kl_coef > 0:
        ref_snap = setup.store.fetch(setup.reference, 0)
        ref = decoder(ref_snap, setup.device, dtype)
        ref.requires_grad_(False)
        nbytes += ref_snap.nbytes
    return model, ref, nbytes
