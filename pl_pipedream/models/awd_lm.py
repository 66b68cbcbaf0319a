"""``AWDLM``: the AWD-LSTM language model (Merity, Keskar and Socher, 2018), written from the
paper's description and pipelined with one layer per LSTM layer.

Three LSTM layers (400 -> 1150 -> 1150 -> 400 units) between a 400-wide word embedding and a
softmax layer whose weight IS the embedding's (weight tying, section 4.5 of the paper): under
``PipeDreamStrategy`` the two usually land on different stages and the strategy keeps the one
parameter one parameter. With the Penn Treebank's 10,000 words that is the paper's 24M
parameters.

The paper's regularisers are here with its Penn Treebank values (section 6): embedding dropout
(whole words, 0.1), variational ("locked") dropout on the word vectors (0.4), between LSTM layers
(0.3) and on the last layer's output (0.4), and DropConnect on the hidden-to-hidden weights of
every LSTM (weight drop, 0.5). All are off in eval mode, where the strategy's setup compares
``forward`` with the pipeline. Not here: NT-ASGD's switch to averaging (plain SGD at the paper's
learning rate 30, gradients clipped at 0.25 by the Trainer's ``gradient_clip_val``), variable
sequence lengths, activation regularisation (AR/TAR).

Every boundary is one float tensor ``(batch, length, width)``; batches are ``(tokens, targets)``
windows, as ``data.TextDataModule`` gives them. ``scale`` divides every width for small builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["AWDLM"]

EMBEDDING, HIDDEN = 400, 1150  # the paper's widths
SCALES = (1, 2, 5, 10, 25, 50)  # divide both widths


def locked_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """One dropout mask per sequence, shared by all its time steps (variational dropout)."""
    if not training or p == 0.0:
        return x
    mask = x.new_empty(x.shape[0], 1, x.shape[2]).bernoulli_(1 - p) / (1 - p)
    return x * mask


class Embed(nn.Module):
    """Words to vectors, dropping whole words of the table (embedding dropout), then locked
    dropout on the vectors."""

    def __init__(self, vocab: int, width: int, dropoute: float, dropouti: float) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, width)
        nn.init.uniform_(self.table.weight, -0.1, 0.1)
        self.dropoute, self.dropouti = dropoute, dropouti

    def forward(self, tokens: Tensor) -> Tensor:
        weight = self.table.weight
        if self.training and self.dropoute > 0:
            keep = weight.new_empty(weight.shape[0], 1).bernoulli_(1 - self.dropoute)
            weight = weight * keep / (1 - self.dropoute)
        return locked_dropout(F.embedding(tokens, weight), self.dropouti, self.training)


class WeightDropLSTM(nn.Module):
    """One LSTM layer with DropConnect on its hidden-to-hidden weights (one mask per batch),
    then locked dropout on its output."""

    def __init__(self, inputs: int, hidden: int, wdrop: float, dropout: float) -> None:
        super().__init__()
        self.lstm = nn.LSTM(inputs, hidden, batch_first=True)
        self.wdrop, self.dropout = wdrop, dropout

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.wdrop > 0:
            # the attribute, not get_parameter(): under the pipeline a weight version's plain
            # tensor sits in the parameter's slot for the call (runtime.functional.StageCall)
            weight = cast(Tensor, self.lstm.weight_hh_l0)
            dropped = F.dropout(weight, self.wdrop, training=True)
            out, _ = functional_call(self.lstm, {"weight_hh_l0": dropped}, (x,), strict=False)
        else:
            out, _ = self.lstm(x)
        return locked_dropout(out, self.dropout, self.training)


class AWDLM(LightningModule):
    """Next-word prediction over ``num_classes`` words in windows of ``input_shape[0]``.

    Args:
        input_shape: ``(length,)``, the window's length (the data says it).
        num_classes: the vocabulary size (10,000 for the Penn Treebank).
        scale: divides the embedding and hidden widths (one of 1, 2, 5, 10, 25, 50).
        dropoute, dropouti, dropouth, dropout, wdrop: the paper's dropouts (see the module).
        lr: SGD's learning rate; weight_decay: its L2 penalty (the paper's 1.2e-6).
    """

    data_kind = "text"  # pl-pipedream-train pairs it with data=text

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        scale: int = 1,
        dropoute: float = 0.1,
        dropouti: float = 0.4,
        dropouth: float = 0.3,
        dropout: float = 0.4,
        wdrop: float = 0.5,
        lr: float = 30.0,
        weight_decay: float = 1.2e-6,
    ) -> None:
        super().__init__()
        if scale not in SCALES:
            raise ValueError(
                f"AWDLM's scale must divide its widths {EMBEDDING} and {HIDDEN} (scale: {scale}); "
                f"use one of {', '.join(map(str, SCALES))}"
            )
        self.save_hyperparameters()
        self.length, self.vocab = int(input_shape[0]), int(num_classes)
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        width, hidden = EMBEDDING // scale, HIDDEN // scale
        self.embed = Embed(self.vocab, width, dropoute, dropouti)
        sizes = [width, hidden, hidden, width]  # the last layer returns to the embedding width
        self.lstms = nn.ModuleList(
            WeightDropLSTM(sizes[i], sizes[i + 1], wdrop, dropouth if i < 2 else dropout)
            for i in range(3)
        )
        self.head = nn.Linear(width, self.vocab)
        self.head.weight = self.embed.table.weight  # tied, as the paper does
        nn.init.zeros_(self.head.bias)
        self.example_input_array = torch.zeros(2, self.length, dtype=torch.long)

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.embed, *self.lstms, self.head)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.configure_pipeline()(tokens)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, targets = batch
        return self.loss(self(tokens), targets)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        tokens, targets = batch
        loss = self.loss(self(tokens), targets)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", loss.exp(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
