"""Fit a small pipelined MLP with and without ``recompute``, as a user's script would.

Run as ``python tests/strategy/memory_script.py --configs async:1:0 ... --out DIR``; each
config is ``sync:recompute:dropout`` (0 or 1), fitted in turn in the same processes. Every rank
writes its stage's weights (``DIR/<config>/rank<r>.pt``); rank 0 writes the memory report
(``report.json``). ``--memory`` with ``--devices`` plans automatically under that limit.
The tests call ``main(argv)`` on ranks forked from their own process (``launched``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pl_pipedream import PipeDreamStrategy  # noqa: E402
from tests.runtime.test_executor import make_batches  # noqa: E402
from tests.runtime.test_recompute import make_dropout_model  # noqa: E402
from tests.strategy.test_lightning_features import Net  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["async:1:0"])
    parser.add_argument("--balance", type=int, nargs="+", default=[3, 3])
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--memory", default=None)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    m = args.microbatches
    batches = make_batches(m)
    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    for config in args.configs:
        sync, recompute, dropout = config.split(":")
        module = Net("sgd")
        if dropout == "1":
            module.net = make_dropout_model()
        if args.memory is not None:
            settings = {"memory": args.memory}
            devices = args.devices
        else:
            settings = {"balance": args.balance}
            devices = len(args.balance)
        strategy = PipeDreamStrategy(
            sync=sync, microbatches=m, timeout=60, recompute=recompute == "1", **settings
        )
        trainer = Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=devices,
            max_epochs=1,
            use_distributed_sampler=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            enable_checkpointing=False,
        )
        torch.manual_seed(7)  # the dropout draws, the same on every run of a rank
        trainer.fit(module, DataLoader(data, batch_size=2 * m, shuffle=False))
        out = Path(args.out) / config.replace(":", "-")
        out.mkdir(parents=True, exist_ok=True)
        local = {k: v for k, v in module.state_dict().items() if v.device.type != "meta"}
        torch.save(local, out / f"rank{trainer.global_rank}.pt")
        if trainer.is_global_zero:
            rows = [asdict(row) for row in strategy.memory_report]
            plan = strategy.plan.to_dict() if strategy.plan is not None else None
            (out / "report.json").write_text(json.dumps({"rows": rows, "plan": plan}))


if __name__ == "__main__":
    main()
