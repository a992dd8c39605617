"""Every registered trainer through the same cases, as the worker drives it: built at a shift from the GPS,
judged groups accumulated, a group joined, a step, a publish; its state saved and taken up by the next
trainer. On one CPU device, in fp32, each update is the one plain trainer's (within 1e-5)."""

from __future__ import annotations

import pytest
import torch

from pivotrl.gps import Kind, LocalStore, ParameterStore, module_tensors
from pivotrl.train.group import TrainGroup
from pivotrl.train.protocol import StepResult, Trainer, TrainSetup
from pivotrl.train.registry import TRAINERS, build
from pivotrl.train.shards import shard_name
from pivotrl.train.traits import TRAITS, TrainerKind
from tests.train.test_fsdp import CFG, MODEL, assert_same_stats, config, initial, one_device
from tests.train.test_replicated import Batch, batch_tokens, make_batch, max_diff

CHECKPOINT = f"{MODEL}.checkpoint"
KINDS = [pytest.param(kind, id=kind.value) for kind in TrainerKind]


@pytest.fixture(scope="module")
def batches() -> list[Batch]:
    return [make_batch(3, seed=1), make_batch(2, seed=2)]


def published() -> LocalStore:
    """A GPS holding the policy's first version, as a run starts."""
    store = LocalStore()
    store.publish(MODEL, 0, module_tensors(initial()), Kind.WEIGHTS, {"config": config().to_hf()})
    return store


def setup(store: ParameterStore, version: int) -> TrainSetup:
    weights = store.fetch(MODEL, version)
    cpu, fp32 = torch.device("cpu"), torch.float32
    return TrainSetup(store, version, weights, cpu, CFG, 1.0, fp32, fp32, MODEL, "reference", CHECKPOINT)


def judged_groups(batch: Batch) -> list[Batch]:
    """The batch as the control plane hands it out: one prompt's group at a time."""
    samples, advantages = batch
    prompts = sorted({s.prompt_index for s in samples})
    pairs = list(zip(samples, advantages, strict=True))
    return [([s for s, _ in pairs if s.prompt_index == p], [a for s, a in pairs if s.prompt_index == p])
            for p in prompts]  # fmt: skip


def accumulate(trainer: Trainer, batch: Batch) -> None:
    for group in judged_groups(batch):
        stats = trainer.accumulate(*group)
        assert (stats == {}) is trainer.traits.lockstep  # a lockstep trainer keeps the group for the step
        assert trainer.traits.lockstep or stats["tokens"] == sum(len(s.response_ids) for s in group[0])


@pytest.fixture
def group(request: pytest.FixtureRequest):
    """One device's train group, with a process group where the trainer needs one alone."""
    kind = request.node.callspec.params["kind"]
    joined = TrainGroup.join(0, 1, device="cpu", process_group=TRAITS[kind].always_grouped)
    yield joined
    joined.leave()


def test_every_trainer_kind_is_registered_with_its_traits():
    assert set(TRAINERS) == set(TrainerKind)
    store = published()
    for kind in TrainerKind:
        assert TRAINERS[kind].traits is TRAITS[kind]
    with pytest.raises(ValueError, match="trainer: got 'deepspeed', must be one of fsdp, zero, replicated"):
        build("deepspeed", setup(store, 0))


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_is_the_plain_update_and_publishes_the_next_version(kind, group, batches):
    store = published()
    trainer = build(kind, setup(store, 0))
    assert trainer.traits.kind is kind and trainer.version == 0
    assert trainer.nbytes == (0 if trainer.traits.lockstep else store.fetch(MODEL, 0).nbytes)  # (built at the step)
    accumulate(trainer, batches[0])
    trainer.join(group, 0)
    result = trainer.step(batch_tokens(batches[0]))
    trainer.publish(checkpoint=True)

    assert isinstance(result, StepResult)
    assert (result.version, result.world_size, trainer.version) == (1, 1, 1)
    assert (result.stats["version"], result.stats["world_size"]) == (1.0, 1.0)
    assert (result.tokens > 0 and result.backward_s > 0) is trainer.traits.lockstep  # backward inside the step
    state, stats = one_device(batches[:1])
    assert_same_stats(result.stats, stats[0])
    assert max_diff(store.fetch(MODEL, 1).state_dict(), state) < 1e-5
    assert max_diff(state, module_tensors(initial())) > 1e-4  # (a real update)
    if trainer.traits.unique_state:  # a checkpoint reads the version's train state from a copy of the shards
        assert store.versions(shard_name(CHECKPOINT, 0, 1), Kind.OPTIMIZER) == [1]
    else:  # ... or from the optimizer state published with the version
        assert store.versions(MODEL, Kind.OPTIMIZER) == [1]


@pytest.mark.parametrize("kind", KINDS)
def test_saved_state_is_taken_up_by_the_next_trainer(kind, group, batches):
    """A device leaves the train role after a step; another takes it up at the new version from the GPS and
    steps on: the two steps are the plain trainer's two (AdamW's moments and step count carried over)."""
    store = published()
    first = build(kind, setup(store, 0))
    accumulate(first, batches[0])
    first.join(group, 0)
    first.step(batch_tokens(batches[0]))
    first.publish(checkpoint=False)
    saved = first.save_state()
    assert (saved is not None and saved > 0) is first.traits.unique_state
    assert first.save_state() is None  # written once
    first.leave()
    first.release()

    second = build(kind, setup(store, 1))
    accumulate(second, batches[1])
    second.join(group, 1 if saved is not None else 0)
    result = second.step(batch_tokens(batches[1]))
    second.publish(checkpoint=False)

    state, stats = one_device(batches)
    assert result.version == 2 and result.stats["version"] == 2.0
    assert_same_stats(result.stats, stats[1])
    assert max_diff(store.fetch(MODEL, 2).state_dict(), state) < 1e-5
