"""Resuming from a sharded checkpoint equals the uninterrupted run: under the plan that saved it
(async drains at epoch end), under another plan (3 stages, another balance, another sync mode),
and from one device to the pipeline and back (``core.resume``, ``core.checkpoint.to_lightning``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.checkpoint import consolidate_checkpoint, to_lightning
from pl_pipedream.core.checkpoint_tools import from_torch
from pl_pipedream.planner.plan import Plan
from tests.runtime import oracle
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, make_batches, make_model
from tests.strategy.test_lightning_features import Net, loader, trainer
from tests.strategy.tied_script import tied_loader, tied_model

FLUSH = 1e-6  # flush equals the uninterrupted run to float rounding


def strategy(
    sync: str = "async",
    balance: list[int] | None = None,
    plan: Plan | None = None,
    start_method: str = "fork",  # the spawn launcher without re-importing Lightning per rank
) -> PipeDreamStrategy:
    return PipeDreamStrategy(
        sync=sync,
        balance=None if plan is not None else balance or [3, 3],
        plan=plan,
        microbatches=2,
        start_method=start_method,
        timeout=60,
    )


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path) -> None:
    """Under the plan that saved it, through the spawn launcher end to end."""
    spawn = {"start_method": "spawn"}
    straight = Net(optimizer="adam")
    trainer(devices=2, strategy=strategy(**spawn), max_epochs=2).fit(straight, loader(2))

    first = Net(optimizer="adam")
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run = trainer(devices=2, strategy=strategy(**spawn), max_epochs=1, callbacks=[saver])
    run.fit(first, loader(2))
    last = tmp_path / "last.ckpt"
    assert (last / "pipeline.json").is_file()

    resumed = Net(optimizer="adam")
    with torch.no_grad():  # only a real restore can undo this
        for param in resumed.parameters():
            param.add_(1.0)
    again = trainer(devices=2, strategy=strategy(**spawn), max_epochs=2)
    again.fit(resumed, loader(2), ckpt_path=last)
    assert_equal_weights(resumed.state_dict(), straight.state_dict(), 1e-6)


class Scheduled(Net):
    """Adam with a learning rate that decays every step: its state must carry over."""

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = OPTIMIZERS[self.optimizer_name](self.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def fit(folder: Path, epochs: int, devices: int = 2, ckpt_path=None, **kwargs) -> Scheduled:  # type: ignore[no-untyped-def]
    """Fit ``Scheduled`` for ``epochs`` (of 5 steps), saving ``folder/last.ckpt`` each epoch;
    ``strategy`` in ``kwargs``, else one device."""
    model = Scheduled(optimizer="adam")
    saver = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)
    run = trainer(devices=devices, max_epochs=epochs, callbacks=[saver], **kwargs)
    run.fit(model, loader(2), ckpt_path=ckpt_path)
    return model


def one_device(path: Path) -> dict:
    """A checkpoint in one device's form: a pipeline's converted, or Lightning's file."""
    return to_lightning(path) if path.is_dir() else torch.load(path, weights_only=False)


def assert_equal_weights(got: dict, expected: dict, tolerance: float) -> None:
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        diff = (got[key] - tensor).abs().max().item()
        assert diff <= tolerance, f"{key}: {diff}"


def assert_same_training_state(got: Path, expected: Path, tolerance: float) -> None:
    """The step, the scheduler, the learning rate and Adam's step counts and moments."""
    got_state, expected_state = one_device(got), one_device(expected)
    assert got_state["global_step"] == expected_state["global_step"] == 10
    assert got_state["lr_schedulers"] == expected_state["lr_schedulers"]
    got_adam, expected_adam = (
        got_state["optimizer_states"][0],
        expected_state["optimizer_states"][0],
    )
    lr = expected_adam["param_groups"][0]["lr"]
    assert got_adam["param_groups"][0]["lr"] == pytest.approx(lr, rel=1e-12)
    assert lr == pytest.approx(0.01 * 0.9**10)
    assert sorted(got_adam["state"]) == sorted(expected_adam["state"]) == list(range(6))
    for index, state in expected_adam["state"].items():
        assert float(got_adam["state"][index]["step"]) == float(state["step"]) == 10.0
        for key in ("exp_avg", "exp_avg_sq"):
            diff = (got_adam["state"][index][key] - state[key]).abs().max().item()
            assert diff <= tolerance, f"{index} {key}: {diff}"
    assert_equal_weights(got_state["state_dict"], expected_state["state_dict"], tolerance)


@pytest.fixture(scope="module")
def flush_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted 2-stage flush run (10 steps) and one stopped at step 5, saved."""
    root = tmp_path_factory.mktemp("flush")
    fit(root / "straight", 2, strategy=strategy("flush"))
    fit(root / "first", 1, strategy=strategy("flush"))
    return {"straight": root / "straight" / "last.ckpt", "first": root / "first" / "last.ckpt"}


REPLICATED = Plan.from_balance([3, 3], replicas=[2, 1])  # stage 0 on ranks 0 and 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan",
    [Plan.from_balance([2, 2, 2]), Plan.from_balance([2, 4]), REPLICATED],
    ids=["2 stages to 3", "another balance on 2", "replicated 2-1 on 3"],
)
def test_flush_resumes_under_another_plan_as_uninterrupted(
    flush_runs: dict[str, Path], tmp_path: Path, plan: Plan
) -> None:
    layout = strategy("flush", plan=plan)
    resumed = fit(tmp_path, 2, plan.num_workers, flush_runs["first"], strategy=layout)
    assert_same_training_state(tmp_path / "last.ckpt", flush_runs["straight"], FLUSH)
    straight = consolidate_checkpoint(flush_runs["straight"])
    assert_equal_weights(resumed.state_dict(), straight, FLUSH)


@pytest.mark.slow
def test_a_checkpoint_made_from_a_state_dict_starts_from_its_weights_and_fresh_optimizers(
    tmp_path: Path,
) -> None:
    """``pl-pipedream checkpoint from-torch``'s checkpoint (step 0, no optimizer state) on 2
    stages trains as one device does from the same weights."""
    weights = {name: value + 0.25 for name, value in Scheduled("adam").state_dict().items()}
    torch.save(weights, tmp_path / "weights.pt")
    from_torch(tmp_path / "weights.pt", tmp_path / "made")
    piped = fit(tmp_path / "piped", 1, 2, tmp_path / "made", strategy=strategy("flush"))
    alone = Scheduled("adam")
    alone.load_state_dict(weights)
    saver = ModelCheckpoint(dirpath=tmp_path / "alone", save_last=True, save_top_k=0)
    trainer(devices=1, max_epochs=1, callbacks=[saver]).fit(alone, loader(2))
    assert_equal_weights(piped.state_dict(), alone.state_dict(), FLUSH)


@pytest.mark.slow
def test_one_device_and_the_pipeline_resume_each_others_checkpoints(
    flush_runs: dict[str, Path], tmp_path: Path
) -> None:
    straight = fit(tmp_path / "straight", 2, 1)  # one device, uninterrupted
    fit(tmp_path / "first", 1, 1)
    reference = tmp_path / "straight" / "last.ckpt"
    # one device's Lightning checkpoint file, continued on 2 stages
    piped = fit(
        tmp_path / "piped", 2, 2, tmp_path / "first" / "last.ckpt", strategy=strategy("flush")
    )
    assert_equal_weights(piped.state_dict(), straight.state_dict(), FLUSH)
    assert_same_training_state(tmp_path / "piped" / "last.ckpt", reference, FLUSH)
    # the 2-stage checkpoint, converted, continued on one device
    torch.save(to_lightning(flush_runs["first"]), tmp_path / "converted.ckpt")
    alone = fit(tmp_path / "alone", 2, 1, tmp_path / "converted.ckpt")
    assert_equal_weights(alone.state_dict(), straight.state_dict(), FLUSH)
    assert_same_training_state(tmp_path / "alone" / "last.ckpt", reference, FLUSH)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "balance"),
    [("async", [2, 2, 2]), ("2bw", [2, 4])],
    ids=["async on 3 stages", "2bw on another balance"],
)
def test_async_resumed_under_another_plan_equals_the_oracle_from_the_drained_checkpoint(
    tmp_path: Path, sync: str, balance: list[int]
) -> None:
    """Async saved drained at step 5 on 2 stages, continued under another plan (and sync
    mode): the oracle of the new pipeline started from the checkpoint's weights and momentum."""
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    run = trainer(devices=2, strategy=strategy("async"), max_epochs=1, callbacks=[saver])
    run.fit(Net(optimizer="sgd"), loader(2))
    resumed = Net(optimizer="sgd")
    plan = Plan.from_balance(balance)
    layout = strategy(sync, balance)
    trainer(devices=len(balance), strategy=layout, max_epochs=2).fit(
        resumed, loader(2), ckpt_path=tmp_path / "last.ckpt"
    )
    saved = to_lightning(tmp_path / "last.ckpt")
    start = make_model()
    start.load_state_dict({k.removeprefix("net."): v for k, v in saved["state_dict"].items()})
    state = saved["optimizer_states"][0]["state"]
    momentum = [state[index]["momentum_buffer"] for index in sorted(state)]  # module order
    given: list[int] = []

    def sgd_from_checkpoint(params):  # type: ignore[no-untyped-def]
        """The oracle's optimizer of one stage (built in stage order, over a copy of
        ``start``), with the saved momentum of its parameters."""
        optimizer = OPTIMIZERS["sgd"](params)
        for param in params:
            optimizer.state[param]["momentum_buffer"] = momentum[len(given)].clone()
            given.append(1)
        return optimizer

    expected = oracle.train(start, plan, sync, make_batches(2), 2, loss_fn, sgd_from_checkpoint)
    expected = {f"net.{k}": v for k, v in expected.items()}
    assert_equal_weights(resumed.state_dict(), expected, 1e-6)


FIRST_FORMAT = Path(__file__).parent / "checkpoints" / "first-format.ckpt"
"""Written by the base commit 323e383 (optimizer state by position over each stage's parameters):
``Scheduled``, flush, balance [3, 3], microbatches 2, saved at the end of epoch 1 (step 5)."""


@pytest.mark.slow
def test_a_first_format_checkpoint_resumes_under_its_plan_and_is_refused_under_another(
    flush_runs: dict[str, Path], tmp_path: Path
) -> None:
    fit(tmp_path, 2, 2, FIRST_FORMAT, strategy=strategy("flush"))
    assert_same_training_state(tmp_path / "last.ckpt", flush_runs["straight"], FLUSH)
    with pytest.raises(Exception) as error:
        fit(tmp_path / "other", 2, 3, FIRST_FORMAT, strategy=strategy("flush", [2, 2, 2]))
    assert (
        "a checkpoint whose optimizer state is keyed by position resumes only under the plan "
        "that saved it (saved: 1-1 with layers [['0', '1', '2'], ['3', '4', '5']], now: 1-1-1"
    ) in str(error.value)
    assert "resume it once with Trainer(devices=2) and PipeDreamStrategy(plan=" in str(error.value)


class WrongModel(Scheduled):
    """Another last layer and one more module than the checkpoint's model."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.net[4] = torch.nn.Linear(8, 4)
        self.extra = torch.nn.Linear(2, 2)


@pytest.mark.slow
def test_a_wrong_model_is_listed_before_any_rank_trains(flush_runs: dict[str, Path]) -> None:
    run = trainer(devices=3, strategy=strategy("flush", [2, 2, 2]), max_epochs=2)
    with pytest.raises(Exception) as error:
        run.fit(WrongModel(), loader(2), ckpt_path=flush_runs["first"])
    assert (
        "a checkpoint resumes into the model that saved it: the same state names and shapes "
        "(missing: [extra.weight, extra.bias]; shapes: [net.4.weight [3, 8] in the checkpoint, "
        "[4, 8] in the model, net.4.bias [3] in the checkpoint, [4] in the model]); resume with "
        "the model"
    ) in str(error.value)


@pytest.mark.slow
def test_a_tied_parameter_resumes_on_every_holder_of_another_plan(tmp_path: Path) -> None:
    """CharGPT's head is its token embedding: held by stages 0 and 1 of [1, 3] when saved, by
    stages 0 and 2 of [1, 1, 2] when resumed; both holders must take its one momentum."""

    def tied_fit(folder: Path, epochs: int, balance: list[int], ckpt_path=None):  # type: ignore[no-untyped-def]
        model = tied_model("sgd")
        saver = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)
        layout = strategy("flush", balance)
        run = trainer(devices=len(balance), strategy=layout, max_epochs=epochs, callbacks=[saver])
        run.fit(model, tied_loader(2), ckpt_path=ckpt_path)
        return model

    straight = tied_fit(tmp_path / "straight", 2, [1, 3])
    tied_fit(tmp_path / "first", 1, [1, 3])
    resumed = tied_fit(tmp_path / "resumed", 2, [1, 1, 2], tmp_path / "first" / "last.ckpt")
    assert_equal_weights(resumed.state_dict(), straight.state_dict(), FLUSH)
    got = to_lightning(tmp_path / "resumed" / "last.ckpt")["optimizer_states"][0]["state"]
    expected = to_lightning(tmp_path / "straight" / "last.ckpt")["optimizer_states"][0]["state"]
    assert sorted(got) == sorted(expected)
    for index, state in expected.items():
        diff = (got[index]["momentum_buffer"] - state["momentum_buffer"]).abs().max().item()
        assert diff <= FLUSH, f"{index}: {diff}"
