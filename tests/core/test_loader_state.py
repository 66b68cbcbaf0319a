"""The loaders users bring train on one device's samples on every plan: a ``DataLoader`` with a
seeded generator and torchdata's shuffling ``StatefulDataLoader``, on a plan of one replicated
stage, a straight plan and a chunked one, see the batches one device sees and end at its
weights; the batch setup draws moves no loader (``core.loader_state``); ranks whose loaders
differ stop at the first step on every plan, a plan of one stage included."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningDataModule, Trainer, seed_everything
from torch.utils.data import DataLoader, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.loader_state import untouched_draw
from pl_pipedream.planner.plan import Plan
from tests.core.test_data import RankDependent, RecordBatches, dataset
from tests.runtime.distributed import run
from tests.strategy.test_lightning_features import Net

LOADERS = ("generator", "stateful", "datamodule")
PLANS = {
    "one replicated stage": lambda: {"plan": Plan.from_balance([6], replicas=[2])},
    "two stages": lambda: {"balance": [3, 3]},
    "chunked": lambda: {"balance": [2, 1, 2, 1], "sync": "interleaved"},
}


class Data(LightningDataModule):
    """A data module that hands out one shuffling loader, seeded by the user."""

    def __init__(self, data: Any) -> None:
        super().__init__()
        self.loader = make_loader("generator", data)

    def train_dataloader(self) -> Any:
        return self.loader


def make_loader(kind: str, data: Any = None) -> Any:
    """A shuffling loader seeded by the user: its own generator, (``stateful``) the generator
    torchdata's sampler draws from the global RNG when it is made, or (``datamodule``) a
    ``LightningDataModule`` giving a loader with its own generator."""
    data = data if data is not None else dataset()
    if kind == "generator":
        seeded = torch.Generator().manual_seed(1)
        return DataLoader(data, batch_size=4, shuffle=True, generator=seeded)
    if kind == "datamodule":
        return Data(data)
    return StatefulDataLoader(data, batch_size=4, shuffle=True)


def orders(loader: Any, epochs: int = 2) -> list[list[float]]:
    return [[float(v) for batch in loader for v in batch[0][:, 0]] for _ in range(epochs)]


# ----- the draw, in one process ----------------------------------------------------------------


@pytest.mark.parametrize("kind", LOADERS[:2])
def test_a_drawn_batch_leaves_the_loader_and_the_global_rngs_as_they_were(kind: str) -> None:
    seed_everything(4)
    expected = orders(make_loader(kind))
    seed_everything(4)
    loader = make_loader(kind)
    states = (torch.get_rng_state(), np.random.get_state()[1].copy())
    first = untouched_draw(loader)
    assert first[0][:, 0].tolist() == expected[0][:4]
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert orders(loader) == expected


def test_a_drawn_batch_leaves_a_resumed_stateful_loader_to_resume_where_it_was() -> None:
    seed_everything(4)
    loader = make_loader("stateful")
    walk = iter(loader)
    next(walk), next(walk)
    state = loader.state_dict()
    rest = [float(b[0][0, 0]) for b in walk]
    seed_everything(4)
    resumed = make_loader("stateful")
    resumed.load_state_dict(state)
    untouched_draw(resumed)
    assert [float(b[0][0, 0]) for b in resumed] == rest


class Stream(IterableDataset):
    """An iterable dataset that goes on from where its last iteration stopped: a position of its
    own (``attribute``), or one inside a list it holds."""

    def __init__(self, attribute: bool) -> None:
        self.attribute = attribute
        self.position = 0
        self.positions = [0]

    def __iter__(self):  # type: ignore[no-untyped-def]
        for _ in range(64):
            if self.attribute:
                self.position += 1
            else:
                self.positions[0] += 1
            yield torch.full((6,), float(self.position + self.positions[0])), torch.zeros(3)


def test_an_iterable_datasets_own_position_is_put_back_after_the_draw() -> None:
    loader = DataLoader(Stream(attribute=True), batch_size=4)
    untouched_draw(loader)
    assert next(iter(loader))[0][:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_draw_that_cannot_be_undone_stops_setup_naming_the_way_around() -> None:
    with pytest.raises(PipelineSetupError) as error:
        untouched_draw(DataLoader(Stream(attribute=False), batch_size=4))
    text = str(error.value)
    assert "must leave the loader as it was" in text and "(loader: DataLoader;" in text
    assert "set example_input_array on the LightningModule and pass balance= or plan=" in text


# ----- real Trainers on two ranks ---------------------------------------------------------------


def fit(out: Path, devices: int, kind: str, plan: str | None, data: Any = None) -> None:
    """Two epochs of ``Net`` (SGD) with the ``kind`` loader, on one device or on two ranks
    (this process is one of them) with ``plan``; the weights go to ``out/weights{rank}.pt``."""
    seed_everything(0)
    settings: dict[str, Any] = {"microbatches": 2, "timeout": 60, "sync": "flush"}
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": devices,
        "max_epochs": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
        "use_distributed_sampler": False,
        "callbacks": [RecordBatches(out)],
    }
    if plan is not None:
        kwargs["strategy"] = PipeDreamStrategy(**{**settings, **PLANS[plan]()})
    model = Net(optimizer="sgd")
    trainer = Trainer(**kwargs)
    trainer.fit(model, make_loader(kind, data))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(weights, out / f"weights{trainer.global_rank}.pt")


def _every_fit(rank: int, world: int, out: str) -> None:
    """Every (loader, plan) in turn, in one launch of 2 ranks."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    for kind in LOADERS:
        for plan in PLANS:
            folder = Path(out) / kind / plan
            folder.mkdir(parents=True, exist_ok=True)
            fit(folder, world, kind, plan)


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("loaders")
    for kind in LOADERS:
        (out / kind / "one device").mkdir(parents=True)
        fit(out / kind / "one device", 1, kind, None)
    for rank, (status, value) in run(2, _every_fit, str(out), timeout=600.0).items():
        assert status == "ok", f"rank {rank}: {value}"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", LOADERS)
def test_every_rank_trains_on_one_devices_samples_to_its_weights(
    fits: Path, kind: str, plan: str
) -> None:
    single = torch.load(fits / kind / "one device" / "rank0.pt")
    weights = torch.load(fits / kind / "one device" / "weights0.pt")
    for rank in range(2):
        seen = torch.load(fits / kind / plan / f"rank{rank}.pt")
        assert len(seen) == len(single)
        for got, expected in zip(seen, single, strict=True):
            assert torch.equal(got, expected), f"rank {rank}"
    held = set()
    for rank in range(2):  # each rank's own layers (the others' are empty on this rank)
        got = torch.load(fits / kind / plan / f"weights{rank}.pt")
        for key, tensor in got.items():
            if not tensor.is_meta and tensor.numel():
                torch.testing.assert_close(tensor, weights[key], rtol=0, atol=1e-5, msg=key)
                held.add(key)
    assert held == set(weights)


def _other_data(rank: int, world: int, out: str) -> str:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    try:
        fit(Path(out), world, "generator", "one replicated stage", data=RankDependent())
    except Exception as error:  # noqa: BLE001 - the message is what the test reads
        return str(error)
    return "trained"


@pytest.mark.slow
def test_replicas_of_one_stage_with_other_data_stop_at_the_first_step(tmp_path: Path) -> None:
    results = run(2, _other_data, str(tmp_path), timeout=120.0)
    for rank, (status, text) in results.items():
        assert status == "ok", text
        assert (
            f"every rank must train on the same batches in the same order (rank {rank} "
            "(stage 0), global step 0, batch 0, microbatch 0: its data differ from those "
            "another rank holds for it" in text
        ), text
        assert "the ranks' loaders give different batches" in text
