"""Re-planning inside a fit: its options, checked when the strategy is built; moves asked for
at given steps (``Replanning.request``) in flush equal one device, and what they save resumes;
``replan="auto"`` moves off a slow plan by itself."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.checkpoint import to_lightning
from pl_pipedream.core.stage import pipeline_layers
from pl_pipedream.engine import session as engine_session
from pl_pipedream.engine.session import Session, Settings
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.replanning import Replanning, refused
from tests.runtime import oracle
from tests.runtime.launched import launch
from tests.runtime.test_executor import loss_fn, make_batches, make_model
from tests.strategy.test_lightning_features import Net, loader, trainer
from tests.strategy.test_resume import (
    FLUSH,
    Scheduled,
    assert_equal_weights,
    assert_same_training_state,
    fit,
    one_device,
    strategy,
)
from tests.strategy.tied_script import tied_model


def test_replan_is_off_by_default_and_stores_its_options() -> None:
    assert PipeDreamStrategy().replanning.mode == "off"
    replanning = PipeDreamStrategy(replan="auto", replan_every=5, replan_threshold=0).replanning
    assert (replanning.mode, replanning.every, replanning.threshold, replanning.on) == (
        "auto",
        5,
        0.0,
        True,
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"replan": "sometimes"},
            "replan must be one of off, auto (replan: 'sometimes'); for example "
            'PipeDreamStrategy(..., replan="auto")',
        ),
        ({"replan": False}, "replan must be one of off, auto (replan: False)"),
        (
            {"replan_every": 0},
            "replan_every must be a positive number of steps (replan_every: 0); for example "
            "PipeDreamStrategy(..., replan_every=50)",
        ),
        ({"replan_every": 2.5}, "(replan_every: 2.5)"),
        (
            {"replan_threshold": -0.1},
            "replan_threshold must be a fraction >= 0 (replan_threshold: -0.1); for example "
            "PipeDreamStrategy(..., replan_threshold=0.05)",
        ),
        ({"replan_threshold": float("nan")}, "(replan_threshold: nan)"),
    ],
)
def test_a_bad_replan_option_is_refused_naming_it_and_the_fix(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        PipeDreamStrategy(**options)
    assert message in str(error.value)


def test_a_requested_plan_waits_for_the_next_boundary() -> None:
    replanning = Replanning()
    assert replanning.requested is None
    replanning.request(Plan.from_balance([1, 2]))
    assert replanning.requested == Plan.from_balance([1, 2])


def test_off_makes_no_replanner_and_its_boundary_touches_nothing() -> None:
    """``replan="off"``: no check, no timeline kept for one, nothing read at the boundary (the
    stand-in strategy has no pipeline: touching it would raise)."""
    replanning = Replanning("off")
    fitting = SimpleNamespace(global_step=0)
    replanning.start(SimpleNamespace(), fitting)
    assert replanning.replanner is None and not replanning.on
    for step in range(1, 500):
        fitting.global_step = step
        replanning.at_step(SimpleNamespace(), fitting)
    assert replanning.moves == 0 and replanning.checks is None


def stand_in(module: Any, world_size: int, sync: str = "flush") -> SimpleNamespace:
    """What ``refused`` reads of a strategy: its processes, microbatches and session."""
    settings = Settings(SyncMode.parse(sync), 2, 0, torch.device("cpu"), 5.0, StagePrecision())
    session = Session(module, pipeline_layers(module), settings, lambda *_: None, list)  # type: ignore[arg-type,return-value]
    return SimpleNamespace(world_size=world_size, microbatches=2, session=session)


def test_a_plan_the_pipeline_cannot_train_under_is_refused_with_the_reason() -> None:
    net = Net()
    assert refused(stand_in(net, 2), Plan.from_balance([1, 5])) is None
    assert refused(stand_in(net, 2), Plan.from_balance([2, 2, 2])) == (
        "the plan has 3 workers for 2 processes"
    )
    assert refused(stand_in(net, 4), Plan.from_balance([3, 3], replicas=[3, 1])) == (
        "replica counts [3] do not divide the microbatches (2) of a batch, which replicas share "
        "round robin"
    )
    tied, layout = tied_model(), Plan.from_balance([1, 3], replicas=[2, 1])
    assert refused(stand_in(tied, 3, "flush"), layout) is None
    reason = refused(stand_in(tied, 3, "async"), layout)
    assert reason is not None and "only without replicated stages (replicas: [2, 1]" in reason


class MoveAt(Callback):
    """Ask every rank's strategy for ``plans[step]`` at the end of that optimizer step."""

    def __init__(self, plans: dict[int, Plan]) -> None:
        self.plans = plans

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        plan = self.plans.get(trainer.global_step)
        if plan is not None:
            trainer.strategy.replanning.request(plan)


class Validated(Scheduled):
    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", loss_fn(self(x), y))


def fit_moving(
    folder: Path,
    epochs: int,
    balance: list[int],
    plans: dict[int, Plan],
    ckpt_path: Path | None = None,
    sync: str = "flush",
    **options: Any,
) -> tuple[Validated, Any]:
    """``Scheduled`` (Adam, a step LR) fitted for ``epochs`` of 5 steps on ``len(balance)``
    processes, moving to ``plans[k]`` after step k, validated each epoch; ``folder/last.ckpt``
    saved every epoch. Returns the model and the Trainer."""
    model = Validated(optimizer="adam")
    strategy = PipeDreamStrategy(
        sync=sync, balance=balance, microbatches=2, start_method="fork", timeout=60, **options
    )
    saver = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)
    logger = CSVLogger(folder, name="logs", version=0)
    run = trainer(
        devices=len(balance),
        strategy=strategy,
        max_epochs=epochs,
        callbacks=[saver, MoveAt(plans)],
        logger=logger,
    )
    run.fit(model, loader(2), loader(2), ckpt_path=ckpt_path)
    return model, run


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One device, 2 epochs (10 steps): ``last.ckpt``."""
    folder = tmp_path_factory.mktemp("alone")
    fit(folder, 2, 1)
    return folder / "last.ckpt"


def saved_plan(checkpoint: Path) -> Plan:
    return Plan.from_dict(json.loads((checkpoint / "pipeline.json").read_text())["plan"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("balance", "plans"),
    [
        ([3, 3], {3: Plan.from_balance([1, 5]), 7: Plan.from_balance([4, 2])}),
        (
            [2, 2, 2],
            {
                2: Plan.from_balance([3, 3], replicas=[2, 1]),
                6: Plan.from_balance([3, 3], replicas=[1, 2]),  # the metrics now from rank 1
            },
        ),
    ],
    ids=["2 processes", "3 processes, through replicated stages"],
)
def test_flush_moving_twice_in_a_fit_equals_one_device(
    alone: Path, tmp_path: Path, balance: list[int], plans: dict[int, Plan]
) -> None:
    """And the validation after the last move reports the last stage's loss on every rank; the
    timeline holds every action of the fit, before the moves too (2 forwards per stage and step)."""
    trace = tmp_path / "timeline.json"
    moved, run = fit_moving(tmp_path, 2, balance, plans, timeline=trace)
    assert_equal_weights(moved.state_dict(), one_device(alone)["state_dict"], FLUSH)
    with torch.no_grad():
        losses = [loss_fn(moved(x), y).item() for x, y in loader(2)]
    assert float(run.callback_metrics["val_loss"]) == pytest.approx(sum(losses) / 5, abs=1e-6)
    events = json.loads(trace.read_text())["traceEvents"]
    forwards = [e for e in events if e.get("cat") == "FORWARD"]
    in_use = [plans.get(max((k for k in plans if k <= t), default=-1)) for t in range(10)]
    initial = Plan.from_balance(balance)
    stages = [initial.num_stages if k is None else k.num_stages for k in in_use]
    assert len(forwards) == 2 * sum(stages)
    assert_same_training_state(tmp_path / "last.ckpt", alone, FLUSH)
    last = plans[max(plans)]
    assert saved_plan(tmp_path / "last.ckpt") == last
    assert (
        Plan.from_json((tmp_path / "logs" / "version_0" / "pipedream_plan.json").read_text())
        == last
    )
    metrics = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    assert "pipedream/replan_seconds" in metrics.splitlines()[0]


@pytest.mark.slow
def test_a_checkpoint_saved_after_a_move_resumes_under_its_plan_and_on_another_number_of_processes(
    alone: Path, tmp_path: Path
) -> None:
    """Moved at step 2 to [1, 5] and saved at step 5, then fitted to step 10 on 2 processes
    (the saved plan) and on 3 (planned afresh for 3: balance left out)."""
    fit_moving(tmp_path / "first", 1, [3, 3], {2: Plan.from_balance([1, 5])})[0]
    first = tmp_path / "first" / "last.ckpt"
    assert saved_plan(first) == Plan.from_balance([1, 5])
    resumed = fit(tmp_path / "two", 2, 2, first, strategy=strategy("flush", plan=saved_plan(first)))
    assert_equal_weights(resumed.state_dict(), one_device(alone)["state_dict"], FLUSH)
    assert_same_training_state(tmp_path / "two" / "last.ckpt", alone, FLUSH)
    three = PipeDreamStrategy(sync="flush", microbatches=2, start_method="fork", timeout=60)
    resumed = fit(tmp_path / "three", 2, 3, first, strategy=three, default_root_dir=tmp_path)
    assert saved_plan(tmp_path / "three" / "last.ckpt").num_workers == 3
    assert_equal_weights(resumed.state_dict(), one_device(alone)["state_dict"], FLUSH)
    assert_same_training_state(tmp_path / "three" / "last.ckpt", alone, FLUSH)


class PlainSGD(Net):
    """SGD without momentum: the oracle's second run starts from the first one's weights alone."""

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["async", "2bw"])
def test_an_async_move_equals_the_oracle_that_drains_and_switches_plans_at_that_step(
    tmp_path: Path, sync: str
) -> None:
    """Minibatches are in flight between steps: the move drains them first. Moved after step 2
    from [3, 3] to [2, 4]: the oracle of [3, 3] over batches 0-1, drained, then of [2, 4]."""
    model = PlainSGD()
    layout = PipeDreamStrategy(
        sync=sync, balance=[3, 3], microbatches=2, start_method="fork", timeout=60
    )
    move = MoveAt({2: Plan.from_balance([2, 4])})
    run = trainer(devices=2, strategy=layout, callbacks=[move], default_root_dir=tmp_path)
    run.fit(model, loader(2))
    batches = make_batches(2)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    before = oracle.train(
        make_model(), Plan.from_balance([3, 3]), sync, batches[:2], 2, loss_fn, sgd
    )
    start = make_model()
    start.load_state_dict(before)
    after = oracle.train(start, Plan.from_balance([2, 4]), sync, batches[2:], 2, loss_fn, sgd)
    assert_equal_weights(model.state_dict(), {f"net.{k}": v for k, v in after.items()}, 1e-6)
    # the move made a difference: the plan kept throughout is another run
    kept = oracle.train(make_model(), Plan.from_balance([3, 3]), sync, batches, 2, loss_fn, sgd)
    differ = max((kept[k] - after[k]).abs().max().item() for k in kept)
    assert differ > 1e-4


class Sleepy(torch.nn.Module):
    """A layer that also sleeps 3 ms per forward: a cost the clock sees, the maths do not."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.003)
        return self.layer(x)


class SleepyNet(Scheduled):
    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.net = torch.nn.Sequential(*(Sleepy(layer) for layer in make_model()))


@pytest.mark.slow
def test_auto_moves_off_a_lopsided_plan_by_itself_and_still_equals_one_device(
    tmp_path: Path,
) -> None:
    """Six layers of equal cost on [1, 5]: the first check (step 2, threshold 0) finds an
    even plan faster, moves, and writes the move to the plan history."""
    reference = SleepyNet()
    trainer(devices=1, max_epochs=2).fit(reference, loader(2))
    model = SleepyNet()
    auto = PipeDreamStrategy(
        sync="flush",
        balance=[1, 5],
        microbatches=2,
        start_method="fork",
        timeout=60,
        replan="auto",
        replan_every=2,
        replan_threshold=0.0,
    )
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    logger = CSVLogger(tmp_path, name="logs", version=0)
    run = trainer(devices=2, strategy=auto, max_epochs=2, callbacks=[saver], logger=logger)
    run.fit(model, loader(2))
    assert_equal_weights(model.state_dict(), reference.state_dict(), FLUSH)
    history = tmp_path / "logs" / "version_0" / "pipedream_plan_history.jsonl"
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert lines[0]["step"] == 2
    assert Plan.from_dict(lines[0]["old_plan"]) == Plan.from_balance([1, 5])
    assert lines[0]["seconds"] > 0
    first = Plan.from_dict(lines[0]["new_plan"])
    assert len(first.stages[0].nodes) > 1
    assert saved_plan(tmp_path / "last.ckpt") == Plan.from_dict(lines[-1]["new_plan"])
    assert "pipedream/replan_gain" in (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()


def lose_rank_1_in_a_move(folder: Path) -> None:
    """2 ranks, flush [3, 3], ``last.ckpt`` saved every step; after step 2 every rank moves to
    [1, 5], and rank 1 exits (status 3) as its move begins."""

    class Lose(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            if trainer.global_step == 2:
                trainer.strategy.replanning.request(Plan.from_balance([1, 5]))
                if trainer.global_rank == 1:
                    engine_session.relayout = lambda *args, **kwargs: os._exit(3)

    saver = ModelCheckpoint(
        dirpath=folder / "ckpts", save_last=True, save_top_k=0, every_n_train_steps=1
    )
    layout = PipeDreamStrategy(sync="flush", balance=[3, 3], microbatches=2, timeout=15)
    run = trainer(devices=2, strategy=layout, callbacks=[saver, Lose()], default_root_dir=folder)
    run.fit(Scheduled(optimizer="adam"), loader(2))


@pytest.mark.slow
def test_a_rank_lost_in_a_move_is_named_and_the_last_checkpoint_loads(tmp_path: Path) -> None:
    ranks = launch(
        2, lambda _: lose_rank_1_in_a_move(tmp_path), folder=tmp_path / "ranks", timeout=120
    )
    assert [rank.code for rank in ranks] == [1, 3], [rank.stderr[-2000:] for rank in ranks]
    assert "rank 1 was lost during the move" in ranks[0].error, ranks[0].error
    saved = to_lightning(tmp_path / "ckpts" / "last.ckpt")
    assert saved["global_step"] == 2
    assert sorted(saved["state_dict"]) == sorted(Scheduled(optimizer="adam").state_dict())
