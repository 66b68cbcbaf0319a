"""Throughput of PipeDreamStrategy on 2 CPU ranks, against torch's pipelining and one process.

Run: python benchmarks/pipeline_throughput.py --workload mlp|gpt|overhead --repeats 3

Workloads (benchmarks/throughput_workloads.py): ``mlp`` (8 x Linear(1024), 128 rows per
microbatch), ``gpt`` (a GPT-style decoder: embedding, 4 pre-LayerNorm blocks of width 256 over
windows of 128 tokens, head; 8 windows per microbatch) and ``overhead`` (Linear(16)-ReLU-Linear(16),
8 rows, 600 steps: the fixed cost of a step and of a microbatch). Half the blocks per stage, plain
SGD, every process on one thread. Configurations, interleaved, each run ``--repeats`` times in
fresh processes:

* ``single``: a plain PyTorch loop in one process, the reference for efficiency;
  ``lightning-1``: the same model and samples through a one-process Lightning ``Trainer``;
  ``single-x2``: two independent copies of ``single`` at once (what sharing the 2 cores costs).
* ``ours-<sync>-<m>``: ``Trainer(strategy=PipeDreamStrategy(sync=..., balance=[...],
  microbatches=m), accelerator="cpu", devices=2)``; Lightning's script launcher re-runs this file
  for rank 1. The modes of two stages per rank (``interleaved``, ``zbv``) get the blocks in
  quarters (``stage_count``), placed by the strategy; they are not simulated (``--simulate``
  measures one stage per rank).
* ``torch-<schedule>-<m>``: ``torch.distributed.pipelining`` (``PipelineStage`` over gloo,
  ``Schedule1F1B`` or ``ScheduleGPipe`` with m microbatches), one optimizer step per batch.

Two views. The headline is at EQUAL MICROBATCH: every configuration's matrix products run on
``--microbatch`` rows, so a configuration with m microbatches trains batches of m x
``--microbatch`` rows (``single``, ``lightning-1`` and ``ours-async-1`` batches of
``--microbatch``). The second view, EQUAL MINIBATCH (configurations ending in ``-minibatch``),
gives every configuration batches of ``--microbatch`` rows, which those with m microbatches split
into m microbatches of ``--microbatch / m`` rows (smaller, less efficient matrix products).
Throughput is compared per sample.

Time is rank 0's wall clock from the end of batch ``--warmup - 1`` to the end of the
second-to-last batch (the last one also drains an async pipeline). Efficiency is the one-process
time per sample over twice the pipeline's. The simulator predicts each pipeline's time per batch
from per-stage forward, backward, step, stash-copy and gradient-sum times, each stage measured
alone in its own process while the other stage is measured in another (both cores busy, as in
the pipeline), and from the bandwidth of gloo on loopback measured at each message size. For our
configurations the executor's timeline splits each rank's time per batch by action kind. All of
this runs for every workload (``--no-simulate`` leaves out the stage costs and the simulator).
"""

# The figures below were taken before issue 15, at EQUAL MINIBATCH with the MLP at width 2048
# (the equivalent command now: --workload mlp --width 2048 --configs single single-x2 lightning-1
# ours-async-1 ours-async-1-unbound ours-async-4-minibatch ours-flush-8-minibatch
# ours-gpipe-8-minibatch torch-1F1B-8-minibatch torch-GPipe-8-minibatch; the table's names are
# the old ones, "torch best" is torch's best schedule at equal minibatch).
#
# Measured on the project machine, an AMD EPYC VM (2 shared cores; torch 2.13 CPU, lightning
# 2.6), at commit 87f95b5 (ranks bound to cores of their own):
#
# $ OMP_NUM_THREADS=1 python benchmarks/pipeline_throughput.py --repeats 3 --steps 32
# config               samples/s ms/batch cores  kflt  work effic. sim ms ratio sim(run) ratio
# single                   155.9    820.9  1.00   0.2  1.00         (153.3, 155.9, 159.8)
# single-x2                293.9    435.5  1.99   0.7  0.95  0.943  (271.5, 303.2, 293.9)
# lightning-1              154.2    829.9  1.00   0.2  0.99
# ours-async-1             280.0    457.2  1.92   1.0  0.94  0.898  441.2  1.04  444.2  1.03
# ours-async-1-unbound     284.0    450.7  1.91   1.0  0.95  0.911  441.2  1.02  432.5  1.04
# ours-async-4             184.5    693.6  1.91   0.7  0.62  0.592  622.5  1.11  681.2  1.02
# ours-flush-8             150.7    849.3  1.72   0.5  0.56  0.483  885.2  0.96  811.1  1.05
# ours-gpipe-8             153.7    832.9  1.74   0.3  0.57  0.493  884.4  0.94  816.2  1.02
# torch-1F1B-8             123.1   1039.7  1.72   0.8  0.46  0.395  977.2  1.06
# torch-GPipe-8            115.0   1113.5  1.72   0.6  0.43  0.369  981.5  1.13
# targets, median of per-repeat ratios: async-1 efficiency 0.898 (0.890, 0.898, 0.918: MISSED
#   by 0.002); async-1 / torch best 2.229 (met); flush-8 / torch-1F1B-8 1.224 (1.282, 1.130,
#   1.224: met). Bound over unbound async-1: 0.982 (0.982, 0.973, 1.033).
#
# Before and after the restructure of issues 10 and 11 (175e7ba against 0646e4a), interleaved,
# three rounds of `--configs single ours-async-1 ours-flush-8 torch-1F1B-8 --repeats 1 --steps 24`
# on another 2-core VM (one process: 501-522 samples/s): async-1 efficiency 0.924, 0.916, 0.896
# before and 0.928, 0.876, 0.956 after; flush-8 / torch-1F1B-8 1.19, 1.20, 1.10 before and 1.18,
# 1.17, 1.18 after.
#
# Earlier runs of the same command: 6dd8aff (before binding): async-1 efficiency 0.809 (0.809,
# 0.922, 0.767), flush-8 / torch-1F1B-8 1.170; db06dee: 0.906 (0.914, 0.831, 0.932) and 1.128.
#
# Where the time goes:
# * async-1 runs at the pace of the last stage, which does 12 of a step's 23 matrix products
#   (the first stage computes no gradient for its input): at best 23 / 24 = 0.958 of twice one
#   process. Two busy cores of this VM also compute less than twice one: two independent copies
#   of the one-process loop (single-x2) reach 0.943 here (0.89-0.99 per repeat). Together these
#   put the ceiling near 0.90-0.92; the last stage's forward and backward (151 / 277 ms per
#   batch) match its cost measured alone (148 / 279 ms), and its gaps between actions are about
#   3 ms per batch ("outside" also counts the actions that straddle the window's edges).
# * Some runs are slower still: one process computes 12-25% slower for the whole run. Two
#   independent copies of the one-process loop show it too when the kernel places them (4 of 6
#   runs), and not when each is bound to a core (0 of 6; the bound single-x2 of repeat 0 above
#   was slowish), hence the binding. Bound async-1 pipelines still had 3 slow runs in 18 (and
#   one where both ranks ran 1.8x slower), against 11 in 30 unbound; the slow rank's core was
#   100% busy: the VM's core itself ran slower. No async-1 run of the table above was slow.
# * Weight stashing costs no copy with SGD: a stashed version shares the live storage and the
#   update writes the new weights out of place (before: 10-12 ms of copy per minibatch on
#   stage 0, the "stash copy" column of the stage costs).
# * flush-8/gpipe-8: the Linear layers add each microbatch's weight gradients into the batch's
#   sum inside the GEMM (addmm, beta=1) instead of writing a fresh gradient and adding it (torch
#   pays one gradient sum, 12-14 ms per stage, for every microbatch but the first).
# * Earlier changes this figure reflects: one transfer per message with receives posted ahead,
#   no per-step flush, freed memory kept, the loss seed carrying 1/m.

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput_workloads as work  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from pl_pipedream.planner.plan import Plan  # noqa: E402
from pl_pipedream.runtime.affinity import bind_threads, cpu_share, current_cpus  # noqa: E402
from pl_pipedream.runtime.linear_sums import LinearGradientSums  # noqa: E402
from pl_pipedream.runtime.memory import retain_freed_memory  # noqa: E402
from pl_pipedream.schedule import SYNC_MODES, SyncMode, build, simulate  # noqa: E402

SCRIPT = Path(__file__).resolve()
NUM_STAGES = 2
MINIBATCH = "minibatch"  # the suffix of the equal-minibatch view's configurations
CONFIGS = (
    "single",
    "single-x2",
    "lightning-1",
    "ours-async-1",
    "ours-async-1-unbound",
    "ours-async-4",
    "ours-flush-1",
    "ours-flush-8",
    "ours-gpipe-8",
    "torch-1F1B-2",
    "torch-1F1B-8",
    "torch-GPipe-8",
    "ours-async-4-minibatch",
    "ours-flush-8-minibatch",
    "ours-gpipe-8-minibatch",
    "torch-1F1B-8-minibatch",
    "torch-GPipe-8-minibatch",
)
DEFAULT_CONFIGS = {
    "mlp": [
        "single",
        "single-x2",
        "lightning-1",
        "ours-async-1",
        "ours-async-1-unbound",
        "ours-async-4",
        "ours-flush-8",
        "ours-gpipe-8",
        "torch-1F1B-8",
        "torch-GPipe-8",
        "ours-flush-8-minibatch",
        "torch-1F1B-8-minibatch",
        "torch-GPipe-8-minibatch",
    ],
    "gpt": [
        "single",
        "single-x2",
        "lightning-1",
        "ours-async-1",
        "ours-flush-8",
        "torch-1F1B-8",
        "ours-flush-8-minibatch",
        "torch-1F1B-8-minibatch",
    ],
    "overhead": [
        "single",
        "lightning-1",
        "ours-async-1",
        "ours-flush-1",
        "ours-flush-8",
        "torch-1F1B-2",
        "torch-1F1B-8",
    ],
}
QUICK_CONFIGS = {  # a few seconds each on an idle machine; both views where they apply
    "mlp": ["single", "ours-flush-2", "torch-1F1B-2-minibatch"],
    "gpt": ["ours-async-1", "torch-1F1B-2"],
    "overhead": ["ours-flush-1", "torch-1F1B-2"],
}
OVERHEAD_TARGET_MS = 1.5  # per step with one microbatch, per microbatch with 8
TORCH_AS_OURS = {"1F1B": "flush", "GPipe": "gpipe"}  # the schedule the simulator builds for it
KINDS = (
    "FORWARD",
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "STEP",
    "RECV_ACTIVATION",
    "RECV_GRAD",
    "SEND_ACTIVATION",
    "SEND_GRAD",
)

Result = dict[str, Any]


@dataclass(frozen=True)
class Config:
    """One configuration's name parsed: who runs it, how, and on how many rows."""

    name: str
    owner: str  # single, single-x2, lightning-1, ours or torch
    schedule: str = ""  # our sync mode, or torch's schedule
    microbatches: int = 1
    unbound: bool = False
    equal_minibatch: bool = False

    @staticmethod
    def parse(name: str) -> Config:
        if not name.startswith(("ours-", "torch-")):
            return Config(name, name)
        owner, schedule, m, *rest = name.split("-")
        if not set(rest) <= {"unbound", MINIBATCH} or len(set(rest)) < len(rest):
            raise ValueError(f"unknown suffix (config: {name})")
        return Config(name, owner, schedule, int(m), "unbound" in rest, MINIBATCH in rest)

    @property
    def piped(self) -> bool:
        return self.owner in ("ours", "torch")

    def rows(self, args: argparse.Namespace) -> int:
        """Rows per batch: m microbatches of ``--microbatch`` rows at equal microbatch,
        ``--microbatch`` rows (split m ways) at equal minibatch."""
        return args.microbatch if self.equal_minibatch else self.microbatches * args.microbatch

    def microbatch_rows(self, args: argparse.Namespace) -> int:
        return self.rows(args) // self.microbatches


# ----- the workload, identical in every process -----------------------------------------------


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def bind_rank(rank: int) -> None:
    """Bind this process to its own core, as PipeDreamStrategy binds a rank on CPU."""
    pool = current_cpus()
    share = cpu_share([pool] * NUM_STAGES, range(NUM_STAGES), rank)
    if share is not None:
        bind_threads(share)


def worker_rank() -> int:
    """RANK for the processes this script starts, LOCAL_RANK for the ones Lightning starts."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


# ----- workers: one configuration, in this process and its peers ------------------------------


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


def stage_count(sync: str) -> int:
    """Stages our pipeline cuts for ``sync``: one per rank, or two per rank for the modes of
    several stages per rank (placed by the strategy: interleaved, or in a V), the 4 stages
    torch's loop and V schedules cut."""
    return 2 * NUM_STAGES if SyncMode.parse(sync).chunked else NUM_STAGES


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

    rank = worker_rank()
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
    rank = worker_rank()
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
    rank = worker_rank()
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    module = work.stage_layers(work.make_layers(args), args, rank)
    out = {}
    for rows in args.cost_rows:
        x, y = work.stage_sample(args, rank, rows)
        dist.barrier()
        out[str(rows)] = stage_cost(module, x, y, last=rank == NUM_STAGES - 1)
    dist.destroy_process_group()
    return out


def stage_costs_of(results: list[Result]) -> Result:
    """{rows: [stage 0's costs, stage 1's, ...]} from the ranks' results."""
    return {rows: [result[rows] for result in results] for rows in results[0]}


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


# ----- the driver: every configuration, interleaved, in fresh processes ------------------------


def launch(
    args: argparse.Namespace,
    worker: str,
    extra: list[str],
    ranks: int,
    expected: int = 0,
    script: Path = SCRIPT,
) -> list[Result]:
    """Run ``worker`` of ``script`` (this one by default) in ``ranks`` processes that this
    script starts; return the results of ``expected`` ranks (default ``ranks``; Lightning starts
    our pipeline's rank 1 itself). A worker that fails ends the others and exits with its log."""
    expected = expected or ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(script), "--worker", worker, "--out", str(out)]
        command += [*workload_args(args), *extra]
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        procs = []
        for rank in range(ranks):
            log = open(Path(tmp) / f"log{rank}.txt", "w")  # noqa: SIM115
            rank_env = {**env, "RANK": str(rank)} if ranks > 1 else env
            procs.append((subprocess.Popen(command, env=rank_env, stdout=log, stderr=log), log))
        failed = wait_all([proc for proc, _ in procs], args.timeout)
        for _, log in procs:
            log.close()
        if failed is not None:
            rank, code = failed
            text = Path(procs[rank][1].name).read_text()[-3000:]
            sys.exit(f"worker {shlex.join(command)} failed (rank {rank}, exit {code}):\n{text}")
        paths = [out] + [Path(f"{out}.rank{rank}") for rank in range(1, expected)]
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in paths) and time.monotonic() < deadline:
            time.sleep(0.1)  # Lightning's rank 1 may still be writing when rank 0 exits
        return [json.loads(path.read_text()) for path in paths]


def wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[int, int | None] | None:
    """Wait for every process; at the first that fails (or at ``timeout`` seconds: exit None)
    end the others and return its (rank, exit code)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [proc.poll() for proc in procs]
        bad = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        late = time.monotonic() > deadline and None in codes
        if bad or late:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            return bad[0] if bad else (codes.index(None), None)
        if None not in codes:
            return None
        try:  # wakes at once when it ends, else twice a second: a rank's core is left alone
            procs[codes.index(None)].wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")
SIZE_ARGUMENTS = ("width", "depth", "microbatch", "steps", "warmup", "sequence", "heads", "vocab")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def workload_args(args: argparse.Namespace) -> list[str]:
    given = [f"--workload={args.workload}"]
    given += [f"--{name}={getattr(args, name)}" for name in SIZE_ARGUMENTS]
    given.append("--cost-rows=" + ",".join(map(str, args.cost_rows)))
    flags = {"--default-allocator": args.default_allocator, "--unbound": args.unbound}
    return given + [flag for flag, on in flags.items() if on]


def run_config(args: argparse.Namespace, config: Config) -> list[Result]:
    rows = [f"--batch={config.rows(args)}"]
    if config.owner == "single":
        return launch(args, "single", rows, 1)
    if config.owner == "single-x2":  # two independent copies at once: what sharing costs
        return launch(args, "single", rows, 2)
    if config.owner == "lightning-1":
        return launch(args, "lightning", rows, 1)
    extra = [*rows, f"--m={config.microbatches}"]
    if config.owner == "ours":
        extra += [f"--sync={config.schedule}"] + (["--unbound"] if config.unbound else [])
        return launch(args, "lightning", extra, 1, NUM_STAGES)
    return launch(args, "torch", [*extra, f"--schedule={config.schedule}"], NUM_STAGES)


def steady_window(args: argparse.Namespace, times: list[float]) -> tuple[float, float, int]:
    """(start, end, batches): from the end of warm-up to the end of the second-to-last batch."""
    if len(times) != args.steps:
        raise RuntimeError(
            f"a run must time every batch (batches: {len(times)}, steps: {args.steps})"
        )
    return times[args.warmup - 1], times[-2], args.steps - 1 - args.warmup


def time_by_kind(results: list[Result], window: tuple[float, float, int]) -> list[dict[str, float]]:
    """Per rank, ms per batch spent in each action kind inside the window; the rest is 'outside'
    (Lightning's loop, data, splitting between segments)."""
    start, end, batches = window
    table = []
    for result in results:
        spent = dict.fromkeys(KINDS, 0.0)
        for kind, begin, finish in result.get("timeline", []):
            if begin >= start and finish <= end:
                spent[kind] += finish - begin
        row = {kind: 1e3 * value / batches for kind, value in spent.items()}
        row["outside"] = 1e3 * (end - start) / batches - sum(row.values())
        table.append(row)
    return table


def predict_ms_per_batch(
    args: argparse.Namespace,
    config: Config,
    costs: list[dict[str, float]],
    bandwidth: float,
    ours: bool = True,
) -> float:
    """The simulator's steady-state time per batch for this pipeline. Our weight stashing copies
    nothing with SGD (the update is written out of place) and our Linear layers sum a batch's
    weight gradients inside the GEMM; torch's schedules add every microbatch's gradients into
    ``.grad``, so for them every backward pass but one in m also pays one gradient sum (costs
    without ``copy``/``accumulate`` were measured in the run, where those are inside the action
    times already)."""
    sync, m = sync_of(config), config.microbatches
    plan = Plan.from_balance(work.balance(args))
    message = work.message_bytes(args, config.microbatch_rows(args))
    stages = tuple(replace(s, output_bytes=message if s.index == 0 else 0.0) for s in plan.stages)
    schedule = build(replace(plan, stages=stages), sync, 16, m)
    forward = [c["forward"] for c in costs]
    summed = ours and m > 1 and sync not in ("async", "vertical_sync")
    adds = 0.0 if ours else (m - 1) / m
    backward = [
        c.get("summed backward", c["backward"])
        if summed
        else c["backward"] + adds * c.get("accumulate", 0.0)
        for c in costs
    ]
    result = simulate(
        schedule,
        forward_ms=forward,
        backward_ms=backward,
        bandwidth=bandwidth,
        step_ms=max(c["step"] for c in costs),
    )
    return result.time_per_minibatch_ms * m


def sync_of(config: Config) -> str:
    return config.schedule if config.owner == "ours" else TORCH_AS_OURS[config.schedule]


def run_costs(results: list[Result], config: Config) -> list[dict[str, float]]:
    """Per stage, ms per microbatch of forward and backward and per update of step as the
    pipeline ran them (median over repeats): the simulator fed these checks the schedule model
    by itself."""
    m = config.microbatches
    updates = m if sync_of(config) in ("async", "vertical_sync") else 1
    costs = []
    for rank in range(NUM_STAGES):
        spent = {k: statistics.median(r["kinds"][rank][k] for r in results) for k in KINDS}
        costs.append(
            {
                "forward": spent["FORWARD"] / m,
                "backward": sum(spent[k] for k in KINDS if k.startswith("BACKWARD")) / m,
                "step": spent["STEP"] / updates,
            }
        )
    return costs


def median_costs(runs: list[Result]) -> Result:
    """Field-wise median over repeats of the stage costs (or of the bandwidths)."""
    first = runs[0]
    if isinstance(first, dict) and all(isinstance(v, float) for v in first.values()):
        return {k: statistics.median(r[k] for r in runs) for k in first}
    if isinstance(first, list):
        return [median_costs([r[i] for r in runs]) for i in range(len(first))]  # type: ignore[return-value]
    return {k: median_costs([r[k] for r in runs]) for k in first}


def drive(args: argparse.Namespace) -> None:
    print(f"$ {shlex.join(['OMP_NUM_THREADS=1', 'python', *sys.argv])}")
    print(
        f"{os.cpu_count()} cores, torch {torch.__version__}; {work.describe(args)}, "
        f"{args.microbatch} rows per microbatch, {args.steps} batches of which the first "
        f"{args.warmup} are not timed, SGD, 1 thread per process; allocator: "
        + ("glibc's defaults" if args.default_allocator else "freed memory kept, every process")
    )
    configs = [Config.parse(name) for name in args.configs]
    runs: dict[str, list[Result]] = {c.name: [] for c in configs}
    cost_runs, bandwidth_runs = [], []
    for repeat in range(args.repeats):
        if args.simulate:
            cost_runs.append(stage_costs_of(launch(args, "stage-costs", [], NUM_STAGES)))
            bandwidth_runs.append(launch(args, "bandwidth", [], NUM_STAGES)[0])
        for config in configs:
            results = run_config(args, config)
            runs[config.name].append(measure(args, config, results))
            print(
                f"  repeat {repeat}: {config.name:<24} {runs[config.name][-1]['samples']:8.1f} "
                f"samples/s, {runs[config.name][-1]['cores']:.2f} cores busy, "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    costs, bandwidth = None, None
    if args.simulate:
        costs, bandwidth = median_costs(cost_runs), median_costs(bandwidth_runs)
        print_costs(args, costs, bandwidth)
    print_tables(args, configs, runs, costs, bandwidth)
    print_targets(args, runs)
    print_profile(configs, runs)


def measure(args: argparse.Namespace, config: Config, results: list[Result]) -> Result:
    """Samples/s in rank 0's steady window (summed over the ranks of single-x2's independent
    copies), CPU cores the ranks kept busy, page faults per batch and rank, time by action kind."""
    first, last = args.warmup - 1, args.steps - 2
    window = steady_window(args, results[0]["times"])
    cores, faults, rates = 0.0, [], []
    for result in results:
        wall = result["times"][last] - result["times"][first]
        cores += (result["cpu"][last] - result["cpu"][first]) / wall
        faults.append((result["faults"][last] - result["faults"][first]) / (last - first))
        rates.append((last - first) * config.rows(args) / wall)
    return {
        "samples": sum(rates) if config.owner == "single-x2" else rates[0],
        "cores": cores,
        "faults": faults,
        "kinds": time_by_kind(results, window),
    }


def print_costs(args: argparse.Namespace, costs: Result, bandwidth: Result) -> None:
    print(
        "\neach stage alone in its process, both at once; ms per microbatch (forward / backward / "
        "step / stash copy / gradient sum / backward summing Linear gradients in the GEMM):"
    )
    for rows in args.cost_rows:
        parts = [
            f"stage {s}: "
            + " / ".join(
                f"{c[k]:.1f}"
                for k in ("forward", "backward", "step", "copy", "accumulate", "summed backward")
            )
            for s, c in enumerate(costs[str(rows)])
        ]
        megabytes = work.message_bytes(args, rows) / 1e6
        print(
            f"  {rows} rows (a {megabytes:.2f} MB message over gloo loopback at "
            f"{bandwidth[str(rows)] / 1e9:.2f} GB/s): " + "; ".join(parts)
        )


def print_tables(
    args: argparse.Namespace,
    configs: list[Config],
    runs: dict[str, list[Result]],
    costs: Result | None,
    bandwidth: Result | None,
) -> None:
    median = {c: statistics.median(r["samples"] for r in rs) for c, rs in runs.items()}
    views = (
        (
            f"EQUAL MICROBATCH (headline): every matrix product on {args.microbatch} rows, a "
            f"configuration with m microbatches trains batches of m x {args.microbatch} rows",
            [c for c in configs if not c.equal_minibatch],
        ),
        (
            f"EQUAL MINIBATCH (second view): batches of {args.microbatch} rows, split into m "
            f"microbatches of {args.microbatch} / m rows",
            [c for c in configs if c.equal_minibatch],
        ),
    )
    for title, chosen in views:
        if not chosen:
            continue
        print(f"\n{title}; medians over repeats, per sample:")
        sim = f" {'sim ms':>6} {'ratio':>5} {'sim(run)':>8} {'ratio':>5}" if costs else ""
        print(
            f"{'config':<24} {'samples/s':>9} {'ms/batch':>8} {'ms/mb':>6} {'cores':>5} "
            f"{'kflt':>5} {'work':>5} {'effic.':>6} {'/x2':>5}{sim}  every repeat"
        )
        for config in chosen:
            print_row(args, config, runs, median, costs, bandwidth)
    print(
        "ms/mb: ms per microbatch; cores: CPU seconds of all ranks per wall second; kflt:\n"
        "thousands of page faults per batch (all ranks); work: one process's CPU time per sample\n"
        "over this one's; effic.: samples/s over twice single's; /x2: efficiency over\n"
        "single-x2's; sim: predicted ms per batch from stage costs measured alone; sim(run):\n"
        "from the action times of this run; ratio: measured / predicted"
    )


def print_row(
    args: argparse.Namespace,
    config: Config,
    runs: dict[str, list[Result]],
    median: dict[str, float],
    costs: Result | None,
    bandwidth: Result | None,
) -> None:
    results, rate = runs[config.name], median[config.name]
    single, pair = median.get("single"), median.get("single-x2")
    cores = {c: statistics.median(r["cores"] for r in rs) for c, rs in runs.items()}
    ms = 1e3 * config.rows(args) / rate
    faults = statistics.median(sum(r["faults"]) for r in results) / 1e3
    cells = [
        f"{config.name:<24} {rate:9.1f} {ms:8.1f} {ms / config.microbatches:6.2f} "
        f"{cores[config.name]:5.2f} {faults:5.1f}"
    ]
    if single:  # CPU time per sample of one process over this configuration's
        cells.append(f"{cores['single'] / single / (cores[config.name] / rate):5.2f}")
    else:
        cells.append(" " * 5)
    both = config.piped or config.owner == "single-x2"
    cells.append(f"{rate / (2 * single):6.3f}" if single and both else " " * 6)
    cells.append(f"{rate / pair:5.3f}" if pair and both else " " * 5)
    if costs is not None and bandwidth is not None:
        for predicted in simulated(args, config, results, costs, bandwidth):
            cells.append(f"{predicted:6.1f} {ms / predicted:5.2f}" if predicted else " " * 12)
    values = ", ".join(f"{r['samples']:.1f}" for r in results)
    print(" ".join(cells) + f"  {values}")


def simulated(
    args: argparse.Namespace,
    config: Config,
    results: list[Result],
    costs: Result,
    bandwidth: Result,
) -> tuple[float | None, float | None]:
    """Predicted ms per batch from stage costs measured alone, and from this run's action
    times."""
    if not config.piped or (config.owner == "ours" and stage_count(config.schedule) > NUM_STAGES):
        return None, None  # the stage costs are measured for one stage per rank
    rows = str(config.microbatch_rows(args))
    ours = config.owner == "ours"
    alone = predict_ms_per_batch(args, config, costs[rows], bandwidth[rows], ours)
    if not ours:
        return alone, None
    return alone, predict_ms_per_batch(args, config, run_costs(results, config), bandwidth[rows])


def print_targets(args: argparse.Namespace, runs: dict[str, list[Result]]) -> None:
    """Each target's ratio within every repeat (configurations of one repeat ran back to back),
    and the median of those; a check whose configurations were not run is left out. The
    overhead workload has targets of its own (ms per step and microbatch): the throughput
    targets are for workloads whose compute dominates."""
    if args.workload == "overhead":
        print_overhead(args, runs)
        return

    def rate(*names: str) -> list[float] | None:
        if not all(name in runs for name in names):
            return None
        return [
            max(r["samples"] for r in group)
            for group in zip(*(runs[n] for n in names), strict=True)
        ]

    def ratio(
        top: list[float] | None, bottom: list[float] | None, factor: float = 1.0
    ) -> list[float] | None:
        if top is None or bottom is None:
            return None
        return [a / (factor * b) for a, b in zip(top, bottom, strict=True)]

    torch_schedules = [
        n for n in ("torch-1F1B-8-minibatch", "torch-GPipe-8-minibatch") if n in runs
    ]
    torch_best = rate(*torch_schedules) if torch_schedules else None  # best of the two per repeat
    async1 = rate("ours-async-1")
    checks = [
        ("async-1 / torch-1F1B-8 >= 1.10 (ideal 1.125)", ratio(async1, rate("torch-1F1B-8")), 1.10),
        ("flush-8 / torch-1F1B-8 >= 1.0", ratio(rate("ours-flush-8"), rate("torch-1F1B-8")), 1.0),
        ("async-1 efficiency / single-x2's >= 0.92", ratio(async1, rate("single-x2")), 0.92),
        ("async-1 efficiency", ratio(async1, rate("single"), 2.0), None),
        ("async-4 / torch-1F1B-8", ratio(rate("ours-async-4"), rate("torch-1F1B-8")), None),
        ("gpipe-8 / torch-GPipe-8", ratio(rate("ours-gpipe-8"), rate("torch-GPipe-8")), None),
        ("single-x2 efficiency", ratio(rate("single-x2"), rate("single"), 2.0), None),
        ("lightning-1 / single", ratio(rate("lightning-1"), rate("single")), None),
        ("async-1 bound / unbound", ratio(async1, rate("ours-async-1-unbound")), None),
        ("async-1 / torch best (equal minibatch)", ratio(async1, torch_best), None),
        (
            "flush-8 / torch-1F1B-8 (equal minibatch)",
            ratio(rate("ours-flush-8-minibatch"), rate("torch-1F1B-8-minibatch")),
            None,
        ),
    ]
    ran = [(label, values, goal) for label, values, goal in checks if values is not None]
    if not ran:  # a bare heading would look like a list that lost its rows
        print(
            "\ntargets: none printed, no pair of configurations they compare ran (e.g. "
            "ours-async-1 with torch-1F1B-8, single or single-x2; the default --configs run them)"
        )
        return
    print(
        "\ntargets (met/MISSED against the goal; a row without a goal is for information), "
        "median of per-repeat ratios, at equal microbatch unless labelled:"
    )
    for label, values, goal in ran:
        print_check(label, values, goal, higher=True)


def print_check(label: str, values: list[float], goal: float | None, higher: bool) -> None:
    value = statistics.median(values)
    met = goal is not None and (value >= goal if higher else value <= goal)
    verdict = "" if goal is None else "met" if met else "MISSED"
    each = ", ".join(f"{v:.3f}" for v in values)
    print(f"  {label:<44} {value:7.3f}  {verdict:<6}  ({each})")


def print_overhead(args: argparse.Namespace, runs: dict[str, list[Result]]) -> None:
    """ms per step (one microbatch) or per microbatch, per configuration; targets for ours."""
    print("\nfixed cost, ms per microbatch (per step where m = 1), median over repeats:")
    goals = {"ours-async-1": OVERHEAD_TARGET_MS, "ours-flush-1": OVERHEAD_TARGET_MS}
    goals["ours-flush-8"] = OVERHEAD_TARGET_MS
    for name, results in runs.items():
        config = Config.parse(name)
        ms = [1e3 * config.microbatch_rows(args) / r["samples"] for r in results]
        goal = goals.get(name)
        label = f"{name} <= {goal}" if goal else name
        print_check(label, ms, goal, higher=False)


def print_profile(configs: list[Config], runs: dict[str, list[Result]]) -> None:
    print("\nour pipeline, ms per batch and rank in the steady window (median over repeats):")
    short = (
        "fwd",
        "bwd",
        "bwd-in",
        "bwd-wt",
        "step",
        "recv-act",
        "recv-grad",
        "send-act",
        "send-grad",
        "outside",
    )
    print(f"  {'config':<24} rank " + " ".join(f"{s:>9}" for s in short))
    for config in configs:
        if config.owner != "ours":
            continue
        for rank in range(NUM_STAGES):
            values = [
                statistics.median(r["kinds"][rank][kind] for r in runs[config.name])
                for kind in (*KINDS, "outside")
            ]
            print(f"  {config.name:<24} {rank:>4} " + " ".join(f"{v:9.1f}" for v in values))


# ----- entry point -----------------------------------------------------------------------------


def config_name(name: str) -> str:
    """``name`` if it names a configuration (see ``--configs``), else argparse's error."""
    try:
        config = Config.parse(name)
    except ValueError:
        config = None
    owners = ("single", "single-x2", "lightning-1", "ours", "torch")
    known = config is not None and config.owner in owners and config.microbatches >= 1
    if known and config.owner == "ours":
        known = config.schedule in SYNC_MODES
    if known and config.owner == "torch":
        known = config.schedule in TORCH_AS_OURS and not config.unbound
    if not known:
        raise argparse.ArgumentTypeError(
            f"a configuration is single, single-x2, lightning-1, "
            f"ours-<sync>-<m>[-unbound][-minibatch] or torch-<1F1B|GPipe>-<m>[-minibatch] "
            f"(config: {name}); e.g. ours-flush-8 or torch-1F1B-8-minibatch"
        )
    return name


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=work.WORKLOADS, default="mlp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--configs",
        nargs="+",
        type=config_name,
        help="default: the workload's; any of single, single-x2, lightning-1, "
        "ours-<sync>-<m>[-unbound][-minibatch], torch-<1F1B|GPipe>-<m>[-minibatch], e.g. "
        + " ".join(CONFIGS),
    )
    parser.add_argument("--width", type=int, help="default: the workload's")
    parser.add_argument("--depth", type=int, help="blocks (default: the workload's)")
    parser.add_argument("--microbatch", type=int, help="rows per microbatch (see the views)")
    parser.add_argument("--steps", type=int, help="batches per run")
    parser.add_argument("--warmup", type=int, help="batches not timed")
    parser.add_argument("--sequence", type=int, help="gpt: tokens per row")
    parser.add_argument("--heads", type=int, help="gpt: attention heads")
    parser.add_argument("--vocab", type=int, help="gpt: vocabulary size")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument(
        "--simulate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the stage costs and gloo's bandwidth every repeat and print the simulator's "
        "predictions (default: yes)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, a few configurations, 1 repeat: checks that everything runs (the tests)",
    )
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's allocator as it is in every process, ours included (by default every "
        "process keeps freed memory, as PipeDreamStrategy's ranks do)",
    )
    parser.add_argument(
        "--unbound",
        action="store_true",
        help="leave every process where the kernel places it, ours included (by default each "
        "rank of a configuration with 2 processes is bound to a core of its own, as "
        "PipeDreamStrategy binds its ranks)",
    )
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cost-rows", help=argparse.SUPPRESS)
    parser.add_argument("--sync", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--m", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work.fill_defaults(args)
    if args.configs is None:
        args.configs = (QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)[args.workload]
    if args.quick:
        args.repeats = 1
    configs = [Config.parse(name) for name in args.configs]
    for config in configs:
        if config.rows(args) % config.microbatches:
            raise SystemExit(
                f"an equal-minibatch configuration splits --microbatch rows m ways "
                f"(microbatch: {args.microbatch}, {config.name}); give a --microbatch that "
                f"{config.microbatches} divides"
            )
    if args.cost_rows is None:
        args.cost_rows = sorted({c.microbatch_rows(args) for c in configs if c.piped})
    else:
        args.cost_rows = [int(rows) for rows in args.cost_rows.split(",") if rows]
    return args


def main() -> None:
    args = parse_args()
    if args.worker is None:
        drive(args)
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if not args.default_allocator:
        retain_freed_memory()
    if "RANK" in os.environ and not args.unbound:  # this script's ranks; Lightning's bind later
        bind_rank(worker_rank())
    result = WORKERS[args.worker](args)
    rank = worker_rank()
    Path(args.out if rank == 0 else f"{args.out}.rank{rank}").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
