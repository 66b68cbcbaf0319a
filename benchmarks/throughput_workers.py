"""pipeline_throughput's workers: one configuration's rank in this process (one process, our
pipeline through Lightning, torch's pipelining), gloo's bandwidth, and each stage's costs
measured alone. The workload is identical in every process (``throughput_workloads``).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import harness
import throughput_workloads as work
import torch
import torch.distributed as dist
from throughput_configs import (
    NUM_STAGES,
    Result,
    stage_count,
)
from torch import nn

from pl_pipedream.runtime.affinity import bind_threads, cpu_share, current_cpus
from pl_pipedream.runtime.linear_sums import LinearGradientSums


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def bind_rank(rank: int) -> None:
    """Bind this process to its own core, as PipeDreamStrategy binds a rank on CPU."""
    pool = current_cpus()
    share = cpu_share([pool] * NUM_STAGES, range(NUM_STAGES), rank)
    if share is not None:
        bind_threads(share)


def run_single(args: argparse.Namespace) -> Result:
    layers = work.make_layers(args)
    optimizer = make_optimizer(layers.parameters())
    clock = BatchClock()
    for x, y in work.make_batches(args, args.batch):
        loss = work.loss(layers(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        clock.on_train_batch_end()
    return clock.result()


class BatchClock:
    """Wall clock and this process's CPU time at every batch end; the executor's timeline. Its
    methods are Lightning callback hooks; the loops without Lightning call them by hand (Lightning
    is imported only by the workers that run it: 4 s less per process)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.faults: list[int] = []
        self.timeline: list[tuple[str, float, float]] = []

    def result(self) -> Result:
        return {
            "times": self.times,
            "cpu": self.cpu,
            "faults": self.faults,
            "timeline": self.timeline,
        }

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        runner = getattr(trainer.strategy, "runner", None)
        if runner is not None:
            runner.executor.record_timeline = True

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        runner = getattr(trainer.strategy, "runner", None)
        if runner is not None:
            self.timeline = [(e.kind, e.start, e.end) for e in runner.executor.timeline]


def run_lightning(args: argparse.Namespace) -> Result:
    """A one-process Trainer, or our pipeline on 2 ranks when ``--sync`` is given."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from pl_pipedream import PipeDreamStrategy

    class LightningClock(BatchClock, Callback):
        """The batch clock as a Lightning callback."""

    torch.set_num_threads(1)
    devices: dict[str, Any] = {"devices": 1}
    if args.sync:
        strategy = PipeDreamStrategy(
            sync=args.sync,
            balance=work.balance(args, stage_count(args.sync)),
            microbatches=args.m,
            retain_freed_memory=not args.default_allocator,
            bind_cpus=not args.unbound,
        )
        devices = {"devices": NUM_STAGES, "strategy": strategy}
    clock = LightningClock()
    trainer = Trainer(
        accelerator="cpu",
        **devices,
        max_epochs=1,
        callbacks=[clock],
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    loader = DataLoader(work.make_batches(args, args.batch), batch_size=None, shuffle=False)
    trainer.fit(lightning_module(args), loader)
    return clock.result()


def lightning_module(args: argparse.Namespace) -> Any:
    """The workload's layers and loss as a LightningModule (the pipeline's layers are the
    workload's, in order)."""
    from lightning.pytorch import LightningModule

    class LightningPipeline(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = work.make_layers(args)

        def configure_pipeline(self) -> nn.Sequential:
            return self.net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return work.loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

    return LightningPipeline()


def run_torch(args: argparse.Namespace) -> Result:
    """One rank of ``torch.distributed.pipelining`` with ``--schedule`` and ``--m``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = harness.launched_rank()
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    module = work.stage_layers(work.make_layers(args), args, rank)
    stage = PipelineStage(module, rank, NUM_STAGES, torch.device("cpu"))
    kind = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[args.schedule]
    schedule = kind(stage, n_microbatches=args.m, loss_fn=work.loss)
    optimizer = make_optimizer(module.parameters())
    clock = BatchClock()
    for x, y in work.make_batches(args, args.batch):
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.on_train_batch_end()
    dist.destroy_process_group()
    return clock.result()


def run_bandwidth(args: argparse.Namespace) -> Result:
    """Ping-pong over gloo on loopback: bytes/s for one activation message of each microbatch
    size (``--cost-rows``)."""
    rank = harness.launched_rank()
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    out = {}
    for rows in args.cost_rows:
        buffer = torch.zeros(work.activation_shape(args, rows))
        for _ in range(3):
            ping(buffer, rank)
        count = 20
        start = time.perf_counter()
        for _ in range(count):
            ping(buffer, rank)
        one_way = (time.perf_counter() - start) / (2 * count)
        out[str(rows)] = buffer.numel() * buffer.element_size() / one_way
    dist.destroy_process_group()
    return out


def ping(buffer: torch.Tensor, rank: int) -> None:
    peer = 1 - rank
    if rank == 0:
        dist.send(buffer, peer)
        dist.recv(buffer, peer)
    else:
        dist.recv(buffer, peer)
        dist.send(buffer, peer)


def run_stage_costs(args: argparse.Namespace) -> Result:
    """Per microbatch size (``--cost-rows``), this rank's stage alone in its process (ms of
    forward, backward, step, copy, gradient sum) while the other rank measures the other stage:
    both cores busy, as in a pipeline, where small matrix products on both cores share the
    memory bandwidth."""
    rank = harness.launched_rank()
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    module = work.stage_layers(work.make_layers(args), args, rank)
    out = {}
    for rows in args.cost_rows:
        x, y = work.stage_sample(args, rank, rows)
        dist.barrier()
        out[str(rows)] = stage_cost(module, x, y, last=rank == NUM_STAGES - 1)
    dist.destroy_process_group()
    return out


def stage_cost(module: nn.Module, x: torch.Tensor, y: torch.Tensor, last: bool) -> dict[str, float]:
    """What the executor does per minibatch: the first stage's input needs no gradient, the
    last stage computes the loss and the gradient of its input; ``copy`` is one weight stash
    (into the tensors of an earlier one), ``accumulate`` one addition of a minibatch's gradients
    into an update's sum, ``summed backward`` a backward whose Linear layers add their weight
    gradients into the sum inside the GEMM, as ours do where an update averages a batch."""
    params = list(module.parameters())
    optimizer = make_optimizer(params)
    spare = [p.detach().clone() for p in params]
    total = [p.detach().clone() for p in params]
    samples: dict[str, list[float]] = {
        "forward": [],
        "backward": [],
        "step": [],
        "copy": [],
        "accumulate": [],
        "summed backward": [],
    }
    sums = LinearGradientSums()
    named = dict(module.named_parameters())
    for _ in range(7):
        marks = [time.perf_counter()]
        inputs = x.clone().requires_grad_(True) if last else x
        output = module(inputs)
        root, seed = (work.loss(output, y), None) if last else (output, torch.ones_like(output))
        marks.append(time.perf_counter())
        grads = torch.autograd.grad(root, params + ([inputs] if last else []), seed)
        marks.append(time.perf_counter())
        for param, grad in zip(params, grads, strict=False):
            param.grad = grad
        optimizer.step()
        marks.append(time.perf_counter())
        with torch.no_grad():
            for stash, param in zip(spare, params, strict=True):
                stash.copy_(param)
        marks.append(time.perf_counter())
        for held, grad in zip(total, grads, strict=False):
            held += grad
        marks.append(time.perf_counter())
        for name, begin, end in zip(list(samples)[:-1], marks[:-1], marks[1:], strict=True):
            samples[name].append(1e3 * (end - begin))
        with sums.capture(named):
            output = module(inputs)
        root = work.loss(output, y) if last else output
        begin = time.perf_counter()
        torch.autograd.grad(root, params + ([inputs] if last else []), seed, allow_unused=True)
        samples["summed backward"].append(1e3 * (time.perf_counter() - begin))
        sums.take()
    return {name: statistics.median(values[2:]) for name, values in samples.items()}


WORKERS: dict[str, Callable[[argparse.Namespace], Result]] = {
    "single": run_single,
    "lightning": run_lightning,
    "torch": run_torch,
    "bandwidth": run_bandwidth,
    "stage-costs": run_stage_costs,
}
