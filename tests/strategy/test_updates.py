"""Who applies a stage's updates: the stage inside the pipeline, or Lightning after ``backward``."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.updates import (
    PipelineUpdates,
    TrainerUpdates,
    check_trainer,
    clear_grads,
    lightning_updates,
    step_after_hooks,
)
from tests.runtime.distributed import run

CPU = torch.device("cpu")


def trainer(**kwargs) -> Trainer:  # type: ignore[no-untyped-def]
    return Trainer(accelerator="cpu", devices=1, logger=False, barebones=True, **kwargs)


def stage() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2))


def gradients(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"0.weight": torch.full((2, 2), scale), "0.bias": torch.full((2,), scale)}


class Recorder(LightningModule):
    """A LightningModule over a stage that records its hooks of gradient work: the hook, and
    the gradient of the stage's first weight at that moment."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.net = module
        self.calls: list[tuple[str, list[list[float]] | None]] = []

    def _record(self, hook: str) -> None:
        grad = self.net[0].weight.grad
        self.calls.append((hook, None if grad is None else grad.tolist()))

    def on_after_backward(self) -> None:
        self._record("on_after_backward")

    def on_before_optimizer_step(self, optimizer) -> None:  # type: ignore[no-untyped-def]
        self._record("on_before_optimizer_step")

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):  # type: ignore[no-untyped-def]
        self._record("configure_gradient_clipping")
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def pipeline_updates(module: nn.Module, optimizer, run_trainer=None) -> PipelineUpdates:  # type: ignore[no-untyped-def]
    run_trainer = run_trainer or trainer()
    recorder = Recorder(module)
    run_trainer.strategy.connect(recorder)
    recorder.trainer = run_trainer
    return PipelineUpdates(SyncMode.ASYNC, module, lambda: [optimizer], run_trainer)


def test_each_update_runs_lightnings_hooks_with_the_stages_gradients_on_grad() -> None:
    module = stage()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    updates = pipeline_updates(module, optimizer)
    recorder = updates.trainer.lightning_module
    updates(gradients(1.0), {})
    updates(gradients(2.0), {})
    hooks = ["on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping"]
    assert recorder.calls == [(h, [[1.0, 1.0]] * 2) for h in hooks] + [
        (h, [[2.0, 2.0]] * 2) for h in hooks
    ]
    assert all(p.grad is None for p in module.parameters())  # gone after the step


class NoteHooks(Callback):
    """Notes each hook of gradient work on a callback, with the hook name Lightning set."""

    def __init__(self, calls: list) -> None:  # type: ignore[type-arg]
        self.calls = calls

    def on_after_backward(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("callback on_after_backward", pl_module._current_fx_name))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("callback on_before_optimizer_step", pl_module._current_fx_name))


def test_the_hooks_run_through_the_precision_plugins_public_methods_as_lightning_runs_them() -> (
    None
):
    module = stage()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    run_trainer = Trainer(accelerator="cpu", devices=1, logger=False, gradient_clip_val=0.5)
    updates = pipeline_updates(module, optimizer, run_trainer)
    recorder = updates.trainer.lightning_module
    run_trainer.callbacks.append(NoteHooks(recorder.calls))
    recorder._current_fx_name = "training_step"
    updates(gradients(1.0), {})
    names = [call[0] for call in recorder.calls]
    assert names == [
        "callback on_after_backward",
        "on_after_backward",
        "callback on_before_optimizer_step",
        "on_before_optimizer_step",
        "configure_gradient_clipping",
    ]
    assert recorder.calls[0][1] == "on_after_backward"  # Lightning set each hook's name
    assert recorder._current_fx_name == "training_step"  # and put the step's back
    assert module[0].weight.grad is None  # stepped (clipped to norm 0.5) and zeroed
    assert "step" not in vars(optimizer)  # the optimizer's own step is back


def test_step_after_hooks_puts_back_an_lr_schedulers_wrapper_of_step() -> None:
    module = stage()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # wraps optimizer.step
    wrapper = vars(optimizer)["step"]
    recorder = Recorder(module)
    run_trainer = trainer()
    run_trainer.strategy.connect(recorder)
    recorder.trainer = run_trainer
    for name, param in module.named_parameters():
        param.grad = gradients()[name]
    step_after_hooks(run_trainer.precision_plugin, recorder, optimizer, {})
    assert vars(optimizer)["step"] is wrapper
    assert optimizer.state_dict()["state"][0]["step"] == 1


def test_a_hook_may_change_the_gradient_the_update_applies() -> None:
    module = stage()
    before = module[0].weight.detach().clone()
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    updates = pipeline_updates(module, optimizer)
    recorder = updates.trainer.lightning_module
    recorder.on_before_optimizer_step = lambda opt: module[0].weight.grad.mul_(0.5)
    updates(gradients(4.0), {})
    assert torch.equal(module[0].weight, before - 2.0)


def test_sgd_steps_out_of_place_into_the_storage_and_copies_nothing() -> None:
    module = stage()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    stashed = module[0].weight.data  # a kept weight version shares this storage
    before = stashed.clone()
    storage = {"0.weight": torch.empty(2, 2)}
    copied = pipeline_updates(module, optimizer)(gradients(), storage)
    assert copied == 0
    assert module[0].weight.data_ptr() == storage["0.weight"].data_ptr()
    assert torch.equal(module[0].weight, before - 0.5)
    assert torch.equal(stashed, before)
    assert all(p.grad is None for p in module.parameters())


def test_adam_copies_the_weights_a_version_shares_then_steps_in_place() -> None:
    module = stage()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    stashed = module[0].weight.data
    before = stashed.clone()
    storage = {"0.weight": torch.empty(2, 2)}
    copied = pipeline_updates(module, optimizer)(gradients(), storage)
    assert copied == 4 * 4
    assert module[0].weight.data_ptr() == storage["0.weight"].data_ptr()
    assert torch.equal(stashed, before) and not torch.equal(module[0].weight, before)


def test_a_parameter_no_optimizer_steps_keeps_its_values_in_new_storage() -> None:
    module = stage()
    optimizer = torch.optim.SGD([module[0].bias], lr=0.5)
    before = module[0].weight.detach().clone()
    storage = {"0.weight": torch.empty(2, 2)}
    copied = pipeline_updates(module, optimizer)(gradients(), storage)
    assert copied == 4 * 4
    assert module[0].weight.data_ptr() == storage["0.weight"].data_ptr()
    assert torch.equal(module[0].weight, before)


def test_clipping_by_value_is_per_stage() -> None:
    module = stage()
    before = module[0].weight.detach().clone()
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    run_trainer = trainer(gradient_clip_val=0.25, gradient_clip_algorithm="value")
    pipeline_updates(module, optimizer, run_trainer)(gradients(10.0), {})
    assert torch.allclose(module[0].weight, before - 0.25)


def test_clipping_by_norm_is_per_stage() -> None:
    module = stage()
    before = [p.detach().clone() for p in module.parameters()]
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    pipeline_updates(module, optimizer, trainer(gradient_clip_val=1.0))(gradients(10.0), {})
    change = torch.cat(
        [(b - p).flatten() for b, p in zip(before, module.parameters(), strict=True)]
    )
    assert change.norm().item() == pytest.approx(1.0, rel=1e-4)


def test_without_clipping_the_gradient_is_applied_as_is() -> None:
    module = stage()
    before = module[0].weight.detach().clone()
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    pipeline_updates(module, optimizer)(gradients(10.0), {})
    assert torch.allclose(module[0].weight, before - 10.0)


@pytest.mark.parametrize("mode", list(SyncMode))
def test_accumulating_gradients_needs_a_flushed_mode(mode: SyncMode) -> None:
    run_trainer = trainer(accumulate_grad_batches=2)
    if mode.flushes:
        check_trainer(mode, run_trainer)
        return
    with pytest.raises(
        ValueError, match=rf"\(sync: {mode}, accumulate_grad_batches: 2\); use .*sync='flush'"
    ):
        check_trainer(mode, run_trainer)


def test_every_mode_accepts_a_trainer_without_accumulation() -> None:
    for mode in SyncMode:
        check_trainer(mode, trainer())


def trainer_updates(module: nn.Module, run_trainer: Trainer) -> TrainerUpdates:
    return TrainerUpdates(SyncMode.FLUSH, module, lambda: [], run_trainer, 1, CPU)


def test_trainer_updates_hold_the_gradient_until_backward_adds_it_scaled() -> None:
    module = stage()
    updates = trainer_updates(module, trainer(accumulate_grad_batches=2))
    before = module[0].weight.detach().clone()
    loss = torch.tensor(3.0)
    assert updates(gradients(4.0), {}) == 0
    assert module[0].weight.grad is None and torch.equal(module[0].weight, before)
    assert updates.backward(loss) is loss
    assert torch.equal(module[0].weight.grad, torch.full((2, 2), 2.0))
    updates(gradients(2.0), {})
    updates.backward(loss)
    assert torch.equal(module[0].bias.grad, torch.full((2,), 3.0))
    updates.backward(loss)  # nothing held any more
    assert torch.equal(module[0].bias.grad, torch.full((2,), 3.0))


def test_trainer_updates_move_a_shared_storage_before_lightning_steps_in_place() -> None:
    module = stage()
    stashed = module[0].weight.data
    storage = {"0.weight": torch.empty(2, 2)}
    assert trainer_updates(module, trainer())(gradients(), storage) == 4 * 4
    assert module[0].weight.data_ptr() == storage["0.weight"].data_ptr()
    assert torch.equal(module[0].weight, stashed)


def test_pipeline_updates_leave_backward_to_the_pipeline() -> None:
    module = stage()
    loss = torch.tensor(1.0)
    assert (
        pipeline_updates(module, torch.optim.SGD(module.parameters(), lr=1)).backward(loss) is loss
    )
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("mode", list(SyncMode))
def test_stage_updates_pick_the_class_by_mode(mode: SyncMode) -> None:
    updates = lightning_updates(mode, stage(), lambda: [], trainer(), 1, CPU)
    expected = PipelineUpdates if mode.updates_in_pipeline else TrainerUpdates
    assert type(updates) is expected
    assert updates.steps_in_pipeline == mode.updates_in_pipeline


def _clip_over_two_ranks(rank: int, world: int) -> dict[str, list[float]]:
    """Rank r holds gradient 3 or 4 in its own coordinate: the norm over both ranks is 5."""
    out = {}
    for name, clip, replicas, grad in (
        ("stages", 1.0, 1, [3.0, 0.0] if rank == 0 else [0.0, 4.0]),
        ("below", 10.0, 1, [3.0, 0.0] if rank == 0 else [0.0, 4.0]),
        ("replicas", 1.0, 2, [3.0, 4.0]),  # two replicas of one stage: the norm is 5, not 5√2
    ):
        param = nn.Parameter(torch.zeros(2))
        param.grad = torch.tensor(grad)
        updates = TrainerUpdates(SyncMode.FLUSH, nn.Module(), lambda: [], None, replicas, CPU)
        updates.clip_global_norm(torch.optim.SGD([param], lr=1.0), clip)
        out[name] = param.grad.tolist()
    return out


@pytest.mark.slow  # two processes that import Lightning: about 5 s
def test_clip_global_norm_clips_the_norm_over_every_rank() -> None:
    results = run(2, _clip_over_two_ranks, timeout=60.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    first, second = results[0][1], results[1][1]
    assert first["stages"] == pytest.approx([0.6, 0.0], rel=1e-5)
    assert second["stages"] == pytest.approx([0.0, 0.8], rel=1e-5)
    assert first["below"] == [3.0, 0.0] and second["below"] == [0.0, 4.0]
    assert first["replicas"] == second["replicas"] == pytest.approx([0.6, 0.8], rel=1e-5)


def test_an_update_clears_the_gradients_as_zero_grad_does_without_its_profiler_record() -> None:
    """torch's ``zero_grad`` opens a profiler record at every call; an optimizer whose class
    keeps it gets its gradients set to None directly, one that overrides it is called."""
    layer = torch.nn.Linear(2, 2)
    plain = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 2)).sum().backward()
    with torch.profiler.profile() as trace:
        clear_grads(plain)
    assert all(p.grad is None for p in layer.parameters())
    assert not [e for e in trace.events() if "zero_grad" in e.name]
    calls: list[bool] = []

    class Own(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    clear_grads(Own(layer.parameters(), lr=0.1))
    assert calls == [True]
