"""Train ``CharGPT`` (head tied to the token embedding) with PipeDreamStrategy, as a user would.

Run as ``python tests/strategy/tied_script.py --configs flush:sgd 2bw:adam flush:sgd:clip
--balance 1 3 --microbatches 2 --out DIR`` (``:clip``: clip the gradient norm at ``CLIP``).
At the end of each fit every rank saves the sharded checkpoint and rank 0 consolidates it into
``DIR/<sync>-<optimizer>[-clip]/weights.pt``. ``tied_model`` and ``tied_loader`` are what the tests
compare against. The tests call ``main(argv, start_method="fork")`` in their own process: the
ranks fork from it instead of importing Lightning again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import pl_pipedream  # noqa: E402
from pl_pipedream import PipeDreamStrategy  # noqa: E402
from pl_pipedream.data import TextDataModule  # noqa: E402
from pl_pipedream.models import CharGPT  # noqa: E402
from tests.strategy.fit_script import SaveAtEnd  # noqa: E402

LENGTH = 8
NUM_BATCHES = 4
CLIP = 0.05


def tied_model(optimizer: str = "sgd", blocks: int = 2) -> CharGPT:
    torch.manual_seed(0)
    lr = 0.5 if optimizer == "sgd" else 0.01
    return CharGPT(
        [LENGTH], 128, width=16, heads=2, blocks=blocks, optimizer=optimizer, lr=lr, momentum=0.9
    )


def tied_batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    size = 2 * m
    data = TextDataModule(["textwrap"], length=LENGTH, num_examples=size * NUM_BATCHES)
    x, y = data.tensors()
    return [(x[k : k + size], y[k : k + size]) for k in range(0, len(x), size)]


def tied_loader(m: int) -> DataLoader:
    batches = tied_batches(m)
    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    return DataLoader(data, batch_size=2 * m, shuffle=False)


def main(argv: list[str] | None = None, start_method: str = "popen") -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["flush:sgd"])
    parser.add_argument("--balance", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--replicas", type=int, nargs="+", default=None)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    m = args.microbatches
    for config in args.configs:
        sync, optimizer, *clip = config.split(":")  # "flush:sgd:clip" clips the norm at 0.05
        out = Path(args.out) / "-".join([sync, optimizer, *clip])
        plan = pl_pipedream.Plan.from_balance(args.balance, replicas=args.replicas)
        strategy = PipeDreamStrategy(
            sync=sync,
            plan=plan,
            microbatches=m,
            timeout=60,
            recompute=args.recompute,
            start_method=start_method,
        )
        trainer = Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=plan.num_workers,
            max_epochs=1,
            use_distributed_sampler=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            enable_checkpointing=False,
            gradient_clip_val=CLIP if clip else None,
            callbacks=[SaveAtEnd(out)],
        )
        trainer.fit(tied_model(optimizer, args.blocks), tied_loader(m))


if __name__ == "__main__":
    main()
