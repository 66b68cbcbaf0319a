"""The package files one training step runs code in, per front end, read from the interpreter.

A profile hook (``sys.setprofile``) records the file of every Python function called inside the
package while one training step runs, after two steps of warm-up: ``Trainer(strategy=
PipeDreamStrategy(...))``'s step (from ``on_train_batch_start`` to ``on_train_batch_end``) and
``Pipeline.train_step``. Two ranks, ``async``, balance [2, 1], one microbatch (the walk of
ARCHITECTURE.md); the union of both ranks' files is printed, grouped by subpackage.

    OMP_NUM_THREADS=1 python benchmarks/step_files.py

Printed (torch 2.13.0+cpu, Lightning 2.6): ``trainer: one training step runs code in 33 package
files`` (core 5, engine 1: the session, profile 1, runtime 17, schedule 2, strategy 6, trees)
and ``pipeline: ... 31`` (core 6, engine 4, profile 1, runtime 17, schedule 2, trees).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import free_port
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PACKAGE = str(Path(__file__).resolve().parent.parent / "pl_pipedream")
STEP = 2  # the step recorded, after two of warm-up


def recorder() -> tuple[Callable[[], None], Callable[[], set[str]]]:
    """Start and stop a profile hook that collects the package files whose functions run."""
    files: set[str] = set()

    def hook(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(PACKAGE):
            files.add(os.path.relpath(name, PACKAGE))

    def stop() -> set[str]:
        sys.setprofile(None)
        return files

    return lambda: sys.setprofile(hook), stop


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = layers()

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Record(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.stop: Callable[[], set[str]] | None = None

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == STEP:
            start, self.stop = recorder()
            start()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.stop is not None:
            files, self.stop = self.stop(), None
            (self.out / f"trainer{trainer.global_rank}.txt").write_text("\n".join(sorted(files)))


def trainer_step(out: Path) -> None:
    from pl_pipedream import PipeDreamStrategy

    rows = 4 * (STEP + 2)
    data = DataLoader(TensorDataset(torch.randn(rows, 8), torch.randn(rows, 4)), batch_size=4)
    strategy = PipeDreamStrategy(sync="async", balance=[2, 1], start_method="fork", timeout=60)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEP + 2,
        callbacks=[Record(out)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Net(), data)


def pipeline_rank(rank: int, port: int, out: Path) -> None:
    from pl_pipedream import Pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sgd = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
    with Pipeline(layers(), nn.functional.mse_loss, sgd, sync="async", balance=[2, 1]) as pipe:
        batches = [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(STEP + 2)]
        for step, batch in enumerate(batches):
            if step == STEP:
                start, stop = recorder()
                start()
                pipe.train_step(batch)
                (out / f"pipeline{rank}.txt").write_text("\n".join(sorted(stop())))
            else:
                pipe.train_step(batch)
    dist.destroy_process_group()


def report(out: Path, front_end: str) -> None:
    files = set()
    for path in out.glob(f"{front_end}*.txt"):
        files |= set(path.read_text().split())
    groups: dict[str, list[str]] = {}
    for name in sorted(files):
        groups.setdefault(name.split("/")[0] if "/" in name else ".", []).append(name)
    print(f"{front_end}: one training step runs code in {len(files)} package files")
    for group, names in groups.items():
        print(f"  {group:9} {len(names):3}  {' '.join(n.split('/')[-1] for n in names)}")


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    out = Path(tempfile.mkdtemp())
    trainer_step(out)
    mp.start_processes(pipeline_rank, args=(free_port(), out), nprocs=2, start_method="fork")
    report(out, "trainer")
    report(out, "pipeline")


if __name__ == "__main__":
    main()
