"""The same data on every rank: whatever the DataLoader, every rank iterates the batches one device
would, in the same order, and a rank whose data differ stops at its first training step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.data import Fingerprints, SameData, fingerprint, seed_loader
from pl_pipedream.core.errors import PipelineDataError
from pl_pipedream.core.microbatches import slice_batch
from tests.runtime.distributed import run
from tests.strategy.test_lightning_features import Net

SAMPLES = 16


def dataset() -> TensorDataset:
    x = torch.arange(SAMPLES * 6, dtype=torch.float32).reshape(SAMPLES, 6) / (SAMPLES * 6)
    return TensorDataset(x, torch.randn(SAMPLES, 3, generator=torch.Generator().manual_seed(3)))


class DropoutNet(Net):
    """Dropout on the last stage: that rank's global RNG moves on while it trains, so a sampler
    that draws its order from the global RNG would draw another order there in epoch 2."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.net[5] = torch.nn.Dropout(0.2)


class RecordBatches(Callback):
    """Saves the inputs of every training batch this rank iterated to ``out/rank{r}.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.seen.append(batch[0].detach().clone())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.seen, self.out / f"rank{trainer.global_rank}.pt")


def fit(out: Path, devices: int, shuffle: bool, data=None, launched=False, **settings) -> None:  # type: ignore[no-untyped-def]
    """Two epochs of ``DropoutNet`` on one device, or on a two-stage ``flush`` pipeline (spawned,
    or in this process when ``launched``: it is one of the ranks already)."""
    kwargs = {
        "accelerator": "cpu",
        "devices": devices,
        "max_epochs": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
        "callbacks": [RecordBatches(out)],
        **settings,
    }
    if devices > 1:
        launcher = {} if launched else {"start_method": "spawn"}
        kwargs["strategy"] = PipeDreamStrategy(
            sync="flush", balance=[3, 3], microbatches=2, timeout=60, **launcher
        )
    loader = DataLoader(data or dataset(), batch_size=4, shuffle=shuffle)
    Trainer(**kwargs).fit(DropoutNet(), loader)


# ----- the parts, in one process ---------------------------------------------------------------


def test_a_fingerprint_is_the_same_for_equal_data_and_differs_for_other_data() -> None:
    x = torch.randn(64, 300)
    y = torch.arange(64)
    assert fingerprint((x, y)) == fingerprint((x.clone(), y.clone()))
    assert fingerprint((x, y)) != fingerprint((x, y.roll(1)))  # other targets
    assert fingerprint((x, y)) != fingerprint((x[[1, 0, *range(2, 64)]], y))  # two rows swapped
    assert fingerprint((x, y)) != fingerprint((x.reshape(32, 600), y))
    nan = torch.full((4,), float("nan"))
    assert fingerprint(nan) == fingerprint(nan.clone())


def test_a_fingerprint_costs_two_tensor_operations_per_tensor_and_five_per_batch() -> None:
    """Counted, not timed (the machine is shared): the tensor operations one fingerprint runs,
    attribute reads (shape, dtype, device) and numel aside. Before the samples were joined into
    one dot product, each tensor cost nine (18 here)."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = getattr(func, "__name__", str(func))
            if name not in ("__get__", "numel"):
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    data = (torch.randn(8, 16), torch.randn(8, 16))
    fingerprints = Fingerprints()
    expected = fingerprints(data)  # the first call of a layout also builds its weights
    with Count() as count:
        assert fingerprints(data) == expected
    assert len(count.ops) <= 2 * 2 + 5, count.ops
    assert fingerprint(data) == expected


def test_a_batchs_microbatches_are_fingerprinted_in_one_pass_of_five_operations() -> None:
    """``each`` gives every slice's fingerprint (up to the rounding of the sums), with the
    operations of one fingerprint: 8 microbatches cost what one did."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = getattr(func, "__name__", str(func))
            if name not in ("__get__", "numel", "dim"):
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    batch = {"y": torch.arange(64).reshape(64, 1), "x": torch.randn(64, 700)}  # x sampled
    slices = slice_batch(batch, 8)
    fingerprints = Fingerprints()
    expected = fingerprints.each(batch, 8)
    with Count() as count:
        assert fingerprints.each(batch, 8) == expected
    assert len(count.ops) <= 2 * 2 + 1 + 5, count.ops  # x's strided view: one more
    torch.testing.assert_close(expected, [fingerprint(piece) for piece in slices])
    assert len(set(expected)) == 8
    swapped = {"y": batch["y"], "x": batch["x"][[1, 0, *range(2, 64)]]}  # rows 0, 1: slice 0
    assert fingerprints.each(swapped, 8)[1:] == expected[1:]
    assert fingerprints.each(swapped, 8)[0] != expected[0]
    nan = torch.full((4, 3), float("nan"))
    assert fingerprints.each(nan, 2) == fingerprints.each(nan.clone(), 2)
    half = torch.randn(4, 3).to(torch.bfloat16)  # NumPy has no bfloat16: tensor operations
    torch.testing.assert_close(
        fingerprints.each((half, batch["y"][:4]), 2),
        [fingerprint((p, batch["y"][2 * j : 2 * j + 2])) for j, p in enumerate(half.chunk(2))],
    )
    with pytest.raises(ValueError, match=r"equal microbatches \(shapes: \[\(6,\)\]"):
        fingerprints.each(torch.ones(6), 4)


def test_same_data_fingerprints_the_batch_it_is_given_once_and_checks_each_slice() -> None:
    batch = (torch.randn(8, 5), torch.randn(8, 2))
    slices = slice_batch(batch, 4)
    stage0 = SameData(slices, "rank 0 (stage 0)", step=0, batch_idx=0, batch=batch)
    sent = [stage0(j, None) for j in range(4)]
    assert sent == Fingerprints().each(batch, 4)
    other = (batch[0].clone(), batch[1].clone())
    other[1][5] += 1  # microbatch 2's targets
    stage1 = SameData(slice_batch(other, 4), "rank 1 (stage 1)", 0, 0, batch=other)
    assert [stage1(j, sent[j]) for j in (0, 1)] == sent[:2]
    with pytest.raises(PipelineDataError, match="rank 1 \\(stage 1\\), global step 0, batch 0, mi"):
        stage1(2, sent[2])


def test_the_weights_are_kept_per_fingerprints_not_per_process() -> None:
    """Two strategies do not share weights, and ``keep`` bounds how many layouts one holds."""
    first, second = Fingerprints(keep=2), Fingerprints(keep=2)
    data = [torch.randn(4, 3), (torch.randn(5), torch.randn(2, 2)), torch.randn(7)]
    values = [first(item) for item in data]
    assert len(first._weights) == 1  # a third layout after two: built afresh
    assert second._weights == {}
    assert [second(item) for item in data] == values == [fingerprint(item) for item in data]


def test_a_fingerprint_weighs_each_tensor_and_reads_large_integers_exactly() -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    assert fingerprint((x, y)) != fingerprint((y, x))  # the same values in other tensors
    ids = torch.tensor([2**40, 3])
    other = torch.tensor([2**40 + 1, 3])  # equal in float32, not in float64
    assert fingerprint((x, ids)) != fingerprint((x, other))
    assert fingerprint((x, ids)) == fingerprint((x.clone(), ids.clone()))
    long = torch.randn(10_000)  # sampled: every 40th element
    assert fingerprint(long) != fingerprint(long + (torch.arange(10_000) == 0))


def test_a_microbatch_that_differs_from_stage_zeros_names_rank_stage_step_and_the_fix() -> None:
    same = SameData([torch.ones(2)], "rank 1 (stage 1)", step=7, batch_idx=3)
    assert same(0, None) == same(0, fingerprint(torch.ones(2))) == fingerprint(torch.ones(2))
    with pytest.raises(PipelineDataError) as error:
        same(0, fingerprint(torch.zeros(2)))
    text = str(error.value)
    assert "(rank 1 (stage 1), global step 7, batch 3, microbatch 0:" in text
    assert "give every rank an identical DataLoader" in text


def test_seed_loader_seeds_an_unseeded_random_sampler_and_keeps_a_users_generator() -> None:
    orders = []
    for _ in range(2):
        torch.manual_seed(len(orders))  # each "rank" has its own global RNG state
        loader = seed_loader(DataLoader(dataset(), batch_size=4, shuffle=True), seed=11)
        orders.append([b[0][:, 0].tolist() for b in loader])
    assert orders[0] == orders[1]
    own = torch.Generator().manual_seed(5)
    loader = seed_loader(DataLoader(dataset(), shuffle=True, generator=own), seed=11)
    assert isinstance(loader.sampler, RandomSampler) and loader.sampler.generator is own


# ----- a real Trainer on two ranks -------------------------------------------------------------


LOADERS = [(shuffle, sampler) for shuffle in (False, True) for sampler in (True, False)]


def _every_loader(rank: int, world: int, out: str) -> None:
    """The fits of every (shuffle, use_distributed_sampler) in turn, in one launch of 2 ranks."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    for shuffle, sampler in LOADERS:
        folder = Path(out) / f"shuffle={shuffle}-sampler={sampler}"
        fit(folder, world, shuffle, launched=True, use_distributed_sampler=sampler)


@pytest.fixture(scope="module")
def loaders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("loaders")
    for rank, (status, value) in run(2, _every_loader, str(out), timeout=600.0).items():
        assert status == "ok", f"rank {rank}: {value}"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("use_distributed_sampler", [True, False])
def test_every_rank_iterates_the_batches_one_device_would(
    tmp_path: Path, loaders: Path, use_distributed_sampler: bool, shuffle: bool
) -> None:
    folder = loaders / f"shuffle={shuffle}-sampler={use_distributed_sampler}"
    ranks = [torch.load(folder / f"rank{r}.pt") for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 2 * SAMPLES // 4
    for first, second in zip(*ranks, strict=True):
        assert torch.equal(first, second)
    seen = torch.cat(ranks[0][: SAMPLES // 4])
    assert sorted(seen[:, 0].tolist()) == sorted(dataset().tensors[0][:, 0].tolist())
    if not shuffle:  # exactly the batches, in the order, that one device iterates
        fit(tmp_path / "one", 1, shuffle)
        single = torch.load(tmp_path / "one" / "rank0.pt")
        assert len(single) == len(ranks[0])
        for got, expected in zip(ranks[0], single, strict=True):
            assert torch.equal(got, expected)


class RankDependent(Dataset):
    """A dataset that gives each rank other targets (as per-rank augmentation would)."""

    def __init__(self) -> None:
        self.data = dataset()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
        x, y = self.data[index]
        return x, y + (dist.get_rank() if dist.is_initialized() else 0)


@pytest.mark.slow
def test_a_rank_with_other_data_stops_at_the_first_step_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(Exception) as error:
        fit(tmp_path, 2, False, data=RankDependent())
    assert (
        "every rank must train on the same batches in the same order (rank 1 (stage 1), "
        "global step 0, batch 0, microbatch 0" in str(error.value)
    )
