"""``CharGPT``: a small GPT-style decoder language model whose output head is tied to its input
embedding, as GPT-2 ties them (``head.weight = wte.weight``).

The pipeline's layers are the embedding (tokens plus positions), the pre-LayerNorm blocks
(causal self-attention, then an MLP, each with a residual) and the head (final LayerNorm and the
tied projection to the vocabulary). Every boundary between layers is one float tensor
``(batch, sequence, width)``. Under ``PipeDreamStrategy`` the embedding and the head usually land
on different stages, and the strategy keeps the one tied parameter one parameter there
(docs/guide.md, "The sync modes"). There is no dropout, so training is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

__all__ = ["CharGPT"]


class Embedding(nn.Module):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab: int, block: int, width: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small embeddings, as GPT-2 initialises them: the tied head then starts near uniform.

        A reset method of the module (not code in ``__init__``), so that the strategy can replay
        it when the model is built empty (docs/guide.md: "Models larger than one process"); the
        draws and their order are those of the whole build.
        """
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(positions)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the projection to the vocabulary (its weight is tied)."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(x))


class CharGPT(LightningModule):
    """Next-token prediction over ``num_classes`` tokens in windows of ``input_shape[0]``.

    Args:
        input_shape: ``[sequence length]`` of one example (the data module says it).
        num_classes: the vocabulary size.
        width: embedding width; heads: attention heads (dividing ``width``); blocks: 2-4 blocks.
        optimizer: ``"adam"`` or ``"sgd"``; lr: learning rate; momentum: SGD momentum.
    """

    data_kind = "text"  # pl-pipedream-train pairs it with data=text

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        width: int = 64,
        heads: int = 4,
        blocks: int = 2,
        optimizer: str = "adam",
        lr: float = 3e-3,
        momentum: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if len(input_shape) != 1 or width % heads:
            raise ValueError(
                f"CharGPT needs token windows shaped [length] and heads dividing width "
                f"(input_shape: {list(input_shape)}, width: {width}, heads: {heads}); use "
                "data=text and model.heads dividing model.width"
            )
        self.block_size = int(input_shape[0])
        self.vocab = int(num_classes)
        self.optimizer_name, self.lr, self.momentum = optimizer, float(lr), float(momentum)
        self.embed = Embedding(self.vocab, self.block_size, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.head = Head(self.vocab, width)
        self.head.out.weight = self.embed.wte.weight  # tied, as GPT-2 does
        self.example_input_array = torch.zeros(2, self.block_size, dtype=torch.long)

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.embed, *self.blocks, self.head)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.blocks_forward(self.embed(tokens)))

    def blocks_forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, targets = batch
        return self.loss(self(tokens), targets)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        logits = self(tokens)
        accuracy = (logits.argmax(dim=-1) == targets).float().mean()
        self.log("val_loss", self.loss(logits, targets), prog_bar=True)
        self.log("val_acc", accuracy, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return torch.optim.Adam(self.parameters(), lr=self.lr)
