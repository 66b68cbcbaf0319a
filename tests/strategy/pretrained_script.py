"""Fine-tune a small tied GPT-like module from pretrained weights on 2 ranks, as a user's script
would.

Run as ``python tests/strategy/pretrained_script.py --weights FILE [FILE ...] --out DIR
[--epochs N] [--save-last] [--resume CKPT] [--build configure|whole] [--init nanogpt|reset]``:
Lightning's script launcher re-runs this file for rank 1. Each weights file (``none``: no
``pretrained=``) is fitted in turn (``sync="flush"``, ``balance=[2, 2]``, 2 microbatches, Adam,
``seed_everything(0)``) into ``DIR/<i>``, where each rank writes ``rank{r}.pt``: its stage's
state under the module's names after training. ``--save-last`` keeps
``DIR/<i>/ckpts/last.ckpt``; ``--resume`` continues from a checkpoint. ``Tiny`` builds in
``configure_model()`` and initialises as nanoGPT does (``self.apply(init)``, outside any
``reset_parameters``): only pretrained weights can fill it; ``--init reset`` leaves each layer
to its own ``reset_parameters`` (an empty build replays it). The tests call
``main(argv, start_method="fork")`` in their own process, the ranks forked from it, or
``main(argv)`` on each of two ranks they fork as a launcher would (``tests.runtime.launched``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pl_pipedream import PipeDreamStrategy  # noqa: E402

VOCAB, WIDTH, LENGTH = 16, 8, 6


def init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)


class Tiny(LightningModule):
    """Embedding tied to the head, two blocks: layers [embed, block, block, head]."""

    def __init__(self, build: str = "configure", init: str = "nanogpt") -> None:
        super().__init__()
        self.embed: nn.Embedding | None = None
        self.init = init
        if build == "whole":
            self.make()

    def configure_model(self) -> None:
        if self.embed is None:
            self.make()

    def make(self) -> None:
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()),
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)),
        )
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        if self.init == "nanogpt":
            self.apply(init)

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.embed, self.blocks[0], self.blocks[1], self.head)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        tokens, targets = batch
        return F.cross_entropy(self(tokens).reshape(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8, LENGTH + 1), generator=generator)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return DataLoader(data, batch_size=4, shuffle=False)  # 2 batches an epoch


def settings(**kwargs) -> dict:  # type: ignore[no-untyped-def, type-arg]
    return {
        "accelerator": "cpu",
        "use_distributed_sampler": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        **kwargs,
    }


class SaveStage(Callback):
    """At the end of training, on every rank: its stage's state as ``rank{r}.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stage = trainer.strategy.session.local  # type: ignore[attr-defined]
        torch.save(stage.state_dict(pl_module), self.out / f"rank{trainer.global_rank}.pt")


def main(argv: list[str] | None = None, start_method: str = "popen") -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-last", action="store_true")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--build", default="configure", choices=["configure", "whole"])
    parser.add_argument("--init", default="nanogpt", choices=["nanogpt", "reset"])
    args = parser.parse_args(argv)
    for index, weights in enumerate(args.weights):
        out = Path(args.out) / str(index)
        out.mkdir(parents=True, exist_ok=True)
        saver = [ModelCheckpoint(dirpath=out / "ckpts", save_last=True)] if args.save_last else []
        given = {} if weights == "none" else {"pretrained": weights}
        strategy = PipeDreamStrategy(
            sync="flush", balance=[2, 2], microbatches=2, start_method=start_method, **given
        )
        trainer = Trainer(
            **settings(
                strategy=strategy,
                devices=2,
                max_epochs=args.epochs,
                callbacks=[*saver, SaveStage(out)],
                enable_checkpointing=bool(saver),
            )
        )
        seed_everything(0)
        model = Tiny(args.build, args.init)
        trainer.fit(model, loader(), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
