"""Throughput of PipeDreamStrategy on 2 CPU ranks, against torch's pipelining and one process.

Run: python benchmarks/pipeline_throughput.py --repeats 3

One MLP (``--depth`` Linear layers of ``--width`` with ReLU between them, half the layers per
stage), one fixed set of samples, plain SGD, every process on one thread. Configurations,
interleaved, each run ``--repeats`` times in fresh processes:

* ``single``: a plain PyTorch loop in one process, the reference for efficiency;
  ``lightning-1``: the same model and samples through a one-process Lightning ``Trainer``;
  ``single-x2``: two independent copies of ``single`` at once (what sharing the 2 cores costs).
* ``ours-<sync>-<m>``: ``Trainer(strategy=PipeDreamStrategy(sync=..., balance=[4, 4],
  microbatches=m), accelerator="cpu", devices=2)``; Lightning's script launcher re-runs this file
  for rank 1.
* ``torch-<schedule>-8``: ``torch.distributed.pipelining`` (``PipelineStage`` over gloo,
  ``Schedule1F1B`` or ``ScheduleGPipe`` with 8 microbatches), one optimizer step per batch.

Time is rank 0's wall clock from the end of batch ``--warmup - 1`` to the end of the
second-to-last batch (the last one also drains an async pipeline). Efficiency is the one-process
time per sample over twice the pipeline's. The simulator predicts each pipeline's time per batch
from per-stage forward, backward, step, stash-copy and gradient-sum times, each stage measured
alone in its own process while the other stage is measured in another (both cores busy, as in
the pipeline), and from the bandwidth of gloo on loopback measured at each message size. For our
configurations the executor's timeline splits each rank's time per batch by action kind.
"""

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
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from torch import nn  # noqa: E402

from pl_pipedream import PipeDreamStrategy  # noqa: E402
from pl_pipedream.planner.plan import Plan  # noqa: E402
from pl_pipedream.runtime.affinity import bind_threads, cpu_share, current_cpus  # noqa: E402
from pl_pipedream.runtime.linear_sums import LinearGradientSums  # noqa: E402
from pl_pipedream.runtime.memory import retain_freed_memory  # noqa: E402
from pl_pipedream.schedule import build, simulate  # noqa: E402

SCRIPT = Path(__file__).resolve()
NUM_STAGES = 2
MICROBATCH_COUNTS = (1, 4, 8)
CONFIGS = (
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
)
TORCH_AS_OURS = {"1F1B": "flush", "GPipe": "gpipe"}  # the schedule the simulator builds for it
KINDS = (
    "FORWARD",
    "BACKWARD",
    "STEP",
    "RECV_ACTIVATION",
    "RECV_GRAD",
    "SEND_ACTIVATION",
    "SEND_GRAD",
)

Result = dict[str, Any]


# ----- the workload, identical in every process -----------------------------------------------


def make_layers(width: int, depth: int) -> nn.Sequential:
    """``depth`` blocks, Linear + ReLU except the last (plain Linear); the same seed everywhere."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 1)]
    return nn.Sequential(*blocks, nn.Sequential(nn.Linear(width, width)))


def make_batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    shape = (args.steps, args.batch, args.width)
    inputs, targets = (
        torch.randn(shape, generator=generator),
        torch.randn(shape, generator=generator),
    )
    return list(zip(inputs.unbind(), targets.unbind(), strict=True))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def stage_layers(layers: nn.Sequential, stage: int) -> nn.Sequential:
    size = len(layers) // NUM_STAGES
    return layers[stage * size : (stage + 1) * size]


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
    layers = make_layers(args.width, args.depth)
    optimizer = make_optimizer(layers.parameters())
    clock = BatchClock()
    for x, y in make_batches(args):
        loss = F.mse_loss(layers(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        clock.on_train_batch_end()
    return clock.result()


class LightningMLP(LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = make_layers(width, depth)

    def configure_pipeline(self) -> nn.Sequential:
        return self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())


class BatchClock(Callback):
    """Wall clock and this process's CPU time at every batch end; the executor's timeline."""

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

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        runner = getattr(trainer.strategy, "runner", None)
        if runner is not None:
            runner.executor.record_timeline = True

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        runner = getattr(trainer.strategy, "runner", None)
        if runner is not None:
            self.timeline = [(e.kind, e.start, e.end) for e in runner.executor.timeline]


def run_lightning(args: argparse.Namespace) -> Result:
    """A one-process Trainer, or our pipeline on 2 ranks when ``--sync`` is given."""
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    devices: dict[str, Any] = {"devices": 1}
    if args.sync:
        balance = [args.depth // NUM_STAGES] * NUM_STAGES
        strategy = PipeDreamStrategy(
            sync=args.sync,
            balance=balance,
            microbatches=args.m,
            retain_freed_memory=not args.default_allocator,
            bind_cpus=not args.unbound,
        )
        devices = {"devices": NUM_STAGES, "strategy": strategy}
    clock = BatchClock()
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
    loader = DataLoader(make_batches(args), batch_size=None, shuffle=False)
    trainer.fit(LightningMLP(args.width, args.depth), loader)
    return clock.result()


def run_torch(args: argparse.Namespace) -> Result:
    """One rank of ``torch.distributed.pipelining`` with ``--schedule`` and ``--m``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = worker_rank()
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    module = stage_layers(make_layers(args.width, args.depth), rank)
    stage = PipelineStage(module, rank, NUM_STAGES, torch.device("cpu"))
    kind = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[args.schedule]
    schedule = kind(stage, n_microbatches=args.m, loss_fn=F.mse_loss)
    optimizer = make_optimizer(module.parameters())
    clock = BatchClock()
    for x, y in make_batches(args):
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
    """Ping-pong over gloo on loopback: bytes/s for one activation message per microbatch count."""
    rank = worker_rank()
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    out = {}
    for m in MICROBATCH_COUNTS:
        buffer = torch.zeros(args.batch // m, args.width)
        for _ in range(3):
            ping(buffer, rank)
        count = 20
        start = time.perf_counter()
        for _ in range(count):
            ping(buffer, rank)
        one_way = (time.perf_counter() - start) / (2 * count)
        out[str(m)] = buffer.numel() * buffer.element_size() / one_way
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
    """Per microbatch count, this rank's stage alone in its process (ms of forward, backward,
    step, copy, gradient sum) while the other rank measures the other stage: both cores busy,
    as in a pipeline, where small matrix products on both cores share the memory bandwidth."""
    rank = worker_rank()
    dist.init_process_group("gloo", rank=rank, world_size=NUM_STAGES)
    module = stage_layers(make_layers(args.width, args.depth), rank)
    out = {}
    for m in MICROBATCH_COUNTS:
        x, y = torch.randn(2, args.batch // m, args.width)
        dist.barrier()
        out[str(m)] = stage_cost(module, x, y, last=rank == NUM_STAGES - 1)
    dist.destroy_process_group()
    return out


def stage_costs_of(results: list[Result]) -> Result:
    """{m: [stage 0's costs, stage 1's, ...]} from the ranks' results."""
    return {m: [result[m] for result in results] for m in results[0]}


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
        root, seed = (F.mse_loss(output, y), None) if last else (output, torch.ones_like(output))
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
        root = F.mse_loss(output, y) if last else output
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
    args: argparse.Namespace, worker: str, extra: list[str], ranks: int, expected: int = 0
) -> list[Result]:
    """Run ``worker`` in ``ranks`` processes that this script starts; return the results of
    ``expected`` ranks (default ``ranks``; Lightning starts our pipeline's rank 1 itself)."""
    expected = expected or ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(SCRIPT), "--worker", worker, "--out", str(out)]
        command += [*workload_args(args), *extra]
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        procs = []
        for rank in range(ranks):
            log = open(Path(tmp) / f"log{rank}.txt", "w")  # noqa: SIM115
            rank_env = {**env, "RANK": str(rank)} if ranks > 1 else env
            procs.append((subprocess.Popen(command, env=rank_env, stdout=log, stderr=log), log))
        for proc, log in procs:
            code = proc.wait(timeout=args.timeout)
            log.close()
            if code != 0:
                text = Path(log.name).read_text()[-3000:]
                sys.exit(f"worker {shlex.join(command)} failed (exit {code}):\n{text}")
        paths = [out] + [Path(f"{out}.rank{rank}") for rank in range(1, expected)]
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in paths) and time.monotonic() < deadline:
            time.sleep(0.1)  # Lightning's rank 1 may still be writing when rank 0 exits
        return [json.loads(path.read_text()) for path in paths]


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def workload_args(args: argparse.Namespace) -> list[str]:
    given = [f"--{name}={getattr(args, name)}" for name in ("width", "depth", "batch", "steps")]
    flags = {"--default-allocator": args.default_allocator, "--unbound": args.unbound}
    return given + [flag for flag, on in flags.items() if on]


def run_config(args: argparse.Namespace, config: str) -> list[Result]:
    if config == "single":
        return launch(args, "single", [], 1)
    if config == "single-x2":  # two independent copies at once: what sharing the machine costs
        return launch(args, "single", [], 2)
    if config == "lightning-1":
        return launch(args, "lightning", [], 1)
    owner, name, m, *unbound = config.split("-")
    if owner == "ours":
        extra = [f"--sync={name}", f"--m={m}"] + (["--unbound"] if unbound else [])
        return launch(args, "lightning", extra, 1, NUM_STAGES)
    return launch(args, "torch", [f"--schedule={name}", f"--m={m}"], NUM_STAGES)


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
    sync: str,
    m: int,
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
    plan = Plan.from_balance([args.depth // NUM_STAGES] * NUM_STAGES)
    message = args.batch // m * args.width * 4
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


def run_costs(results: list[Result], m: int, sync: str) -> list[dict[str, float]]:
    """Per stage, ms per minibatch of forward, backward and step as the pipeline ran them
    (median over repeats): the simulator fed these checks the schedule model by itself."""
    updates = m if sync in ("async", "vertical_sync") else 1
    costs = []
    for rank in range(NUM_STAGES):
        spent = {k: statistics.median(r["kinds"][rank][k] for r in results) for k in KINDS}
        costs.append(
            {
                "forward": spent["FORWARD"] / m,
                "backward": spent["BACKWARD"] / m,
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
        f"{os.cpu_count()} cores, torch {torch.__version__}; MLP {args.depth} x "
        f"Linear({args.width}), batch {args.batch}, {args.steps} batches of which the first "
        f"{args.warmup} are not timed, SGD, 1 thread per process; allocator: "
        + ("glibc's defaults" if args.default_allocator else "freed memory kept, every process")
    )
    runs: dict[str, list[Result]] = {c: [] for c in args.configs}
    cost_runs, bandwidth_runs = [], []
    for repeat in range(args.repeats):
        cost_runs.append(stage_costs_of(launch(args, "stage-costs", [], NUM_STAGES)))
        bandwidth_runs.append(launch(args, "bandwidth", [], NUM_STAGES)[0])
        for config in args.configs:
            results = run_config(args, config)
            runs[config].append(measure(args, results, independent=config == "single-x2"))
            print(
                f"  repeat {repeat}: {config:<20} {runs[config][-1]['samples']:8.1f} samples/s, "
                f"{runs[config][-1]['cores']:.2f} cores busy, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    costs, bandwidth = median_costs(cost_runs), median_costs(bandwidth_runs)
    print_costs(args, costs, bandwidth)
    print_table(args, runs, costs, bandwidth)
    print_profile(runs)


def measure(args: argparse.Namespace, results: list[Result], independent: bool) -> Result:
    """Samples/s in rank 0's steady window (summed over the ranks of ``independent`` copies),
    CPU cores the ranks kept busy, page faults per batch and rank, time by action kind."""
    first, last = args.warmup - 1, args.steps - 2
    window = steady_window(args, results[0]["times"])
    cores, faults, rates = 0.0, [], []
    for result in results:
        wall = result["times"][last] - result["times"][first]
        cores += (result["cpu"][last] - result["cpu"][first]) / wall
        faults.append((result["faults"][last] - result["faults"][first]) / (last - first))
        rates.append((last - first) * args.batch / wall)
    return {
        "samples": sum(rates) if independent else rates[0],
        "cores": cores,
        "faults": faults,
        "kinds": time_by_kind(results, window),
    }


def print_costs(args: argparse.Namespace, costs: Result, bandwidth: Result) -> None:
    print(
        "\neach stage alone in its process, both at once; ms per minibatch (forward / backward / "
        "step / stash copy / gradient sum / backward summing Linear gradients in the GEMM):"
    )
    for m in MICROBATCH_COUNTS:
        parts = [
            f"stage {s}: "
            + " / ".join(
                f"{c[k]:.1f}"
                for k in ("forward", "backward", "step", "copy", "accumulate", "summed backward")
            )
            for s, c in enumerate(costs[str(m)])
        ]
        megabytes = args.batch // m * args.width * 4 / 1e6
        print(
            f"  m={m} ({args.batch // m} rows; a {megabytes:.2f} MB message over gloo loopback at "
            f"{bandwidth[str(m)] / 1e9:.2f} GB/s): " + "; ".join(parts)
        )


def print_table(
    args: argparse.Namespace, runs: dict[str, list[Result]], costs: Result, bandwidth: Result
) -> None:
    median = {c: statistics.median(r["samples"] for r in rs) for c, rs in runs.items()}
    single = median.get("single")
    cores = {c: statistics.median(r["cores"] for r in rs) for c, rs in runs.items()}
    print(
        f"\n{'config':<20} {'samples/s':>9} {'ms/batch':>8} {'cores':>5} {'kflt':>5} {'work':>5} "
        f"{'effic.':>6} {'sim ms':>6} {'ratio':>5} {'sim(run)':>8} {'ratio':>5}  every repeat"
    )
    for config, results in runs.items():
        ms = 1e3 * args.batch / median[config]
        faults = statistics.median(sum(r["faults"]) for r in results) / 1e3
        cells = [f"{config:<20} {median[config]:9.1f} {ms:8.1f} {cores[config]:5.2f} {faults:5.1f}"]
        if single:  # CPU time per sample of one process over this configuration's
            cells.append(f"{cores['single'] / single / (cores[config] / median[config]):5.2f}")
        piped = config.startswith(("ours", "torch")) or config == "single-x2"
        cells.append(f"{median[config] / (2 * single):6.3f}" if single and piped else " " * 6)
        for predicted in simulated(args, config, results, costs, bandwidth):
            cells.append(f"{predicted:6.1f} {ms / predicted:5.2f}" if predicted else " " * 12)
        values = ", ".join(f"{r['samples']:.1f}" for r in results)
        print(" ".join(cells) + f"  {values}")
    print(
        "cores: CPU seconds of all ranks per wall second; kflt: thousands of page faults per\n"
        "batch (all ranks); work: one process's CPU time per sample over this one's; sim:\n"
        "predicted ms per batch from stage costs measured alone; sim(run):\n"
        "from the action times of this run; ratio: measured / predicted"
    )
    if set(CONFIGS) <= set(runs):
        print_targets(runs)


def simulated(
    args: argparse.Namespace, config: str, results: list[Result], costs: Result, bandwidth: Result
) -> tuple[float | None, float | None]:
    """Predicted ms per batch from stage costs measured alone, and from this run's action
    times."""
    if not config.startswith(("ours", "torch")):
        return None, None
    owner, name, m, *_ = config.split("-")
    sync = name if owner == "ours" else TORCH_AS_OURS[name]
    alone = predict_ms_per_batch(args, sync, int(m), costs[m], bandwidth[m], owner == "ours")
    if owner != "ours":
        return alone, None
    in_run = run_costs(results, int(m), sync)
    return alone, predict_ms_per_batch(args, sync, int(m), in_run, bandwidth[m])


def print_targets(runs: dict[str, list[Result]]) -> None:
    """Each target's ratio within every repeat (configurations of one repeat ran back to back),
    and the median of those."""

    def rate(config: str) -> list[float]:
        return [r["samples"] for r in runs[config]]

    def ratios(top: list[float], bottom: list[float], factor: float = 1.0) -> list[float]:
        return [a / (factor * b) for a, b in zip(top, bottom, strict=True)]

    single = rate("single")
    torch_best = [
        max(pair) for pair in zip(rate("torch-1F1B-8"), rate("torch-GPipe-8"), strict=True)
    ]
    checks = [
        ("async-1 efficiency >= 0.9", ratios(rate("ours-async-1"), single, 2.0), 0.9),
        ("async-4 efficiency", ratios(rate("ours-async-4"), single, 2.0), None),
        ("async-1 / torch best >= 1.1", ratios(rate("ours-async-1"), torch_best), 1.1),
        ("async-4 / torch best", ratios(rate("ours-async-4"), torch_best), None),
        ("flush-8 / torch-1F1B-8 >= 1.0", ratios(rate("ours-flush-8"), rate("torch-1F1B-8")), 1.0),
    ]
    lightning = statistics.median(ratios(rate("lightning-1"), single))
    bound = ratios(rate("ours-async-1"), rate("ours-async-1-unbound"))
    print(
        f"\nlightning-1 / single: {lightning:.3f}; ours-async-1 / ours-async-1-unbound (ranks "
        f"bound to cores of their own or not): {statistics.median(bound):.3f} "
        f"({', '.join(f'{v:.3f}' for v in bound)})"
    )
    print("targets (async-4: for information), median of per-repeat ratios:")
    for label, values, goal in checks:
        value = statistics.median(values)
        each = ", ".join(f"{v:.3f}" for v in values)
        verdict = "" if goal is None else "met" if value >= goal else "MISSED"
        print(f"  {label:<30} {value:6.3f}  {verdict:<6}  ({each})")


def print_profile(runs: dict[str, list[Result]]) -> None:
    print("\nour pipeline, ms per batch and rank in the steady window (median over repeats):")
    short = ("fwd", "bwd", "step", "recv-act", "recv-grad", "send-act", "send-grad", "outside")
    print(f"  {'config':<20} rank " + " ".join(f"{s:>9}" for s in short))
    for config, results in runs.items():
        if not config.startswith("ours"):
            continue
        for rank in range(NUM_STAGES):
            values = [
                statistics.median(r["kinds"][rank][kind] for r in results)
                for kind in (*KINDS, "outside")
            ]
            print(f"  {config:<20} {rank:>4} " + " ".join(f"{v:9.1f}" for v in values))


# ----- entry point -----------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64, help="batches per run")
    parser.add_argument("--warmup", type=int, default=5, help="batches not timed")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
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
    parser.add_argument("--sync", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--m", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args()


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
