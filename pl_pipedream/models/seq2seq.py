"""``Seq2Seq``: a small LSTM encoder-decoder with attention (GNMT-like), pipelined by layers.

Its stage boundaries carry several tensors and plain values, as an encoder-decoder's do: the
embedding layer returns a dict of the source's states (``memory``), the decoder's input stream,
the source tokens (an integer tensor, which gets no gradient) and the encoder's final state
(``None`` until the encoder has run); the encoder fills in ``memory`` and ``state``; the decoder
returns a tuple (memory, decoded stream, source tokens, attention scale as a Python float);
attention and the output layer make one tensor of logits. Every layer takes the previous one's
output as its one argument, as ``nn.Sequential`` passes it, so the same module trains the same
on one device and through the pipeline, wherever the cuts fall.

Batches are ``(source, decoder input, target)`` token tensors (``data.SequenceDataModule``);
``pipeline_split_batch`` hands ``(source, decoder input)`` to the first layer. Token 0 pads,
token 1 starts the decoder's input; the loss ignores padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

__all__ = ["TokenSequenceModel", "PAD", "START", "Seq2Seq"]

PAD, START = 0, 1  # the tokens data.SequenceDataModule pads with and starts the decoder with


class Embed(nn.Module):
    """Source and decoder-input tokens to vectors (one table for both)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, hidden, padding_idx=PAD)

    def forward(self, tokens: tuple[Tensor, Tensor]) -> dict[str, Any]:
        source, decoder_input = tokens
        return {
            "memory": self.table(source),
            "stream": self.table(decoder_input),
            "source": source,
            "state": None,
        }


class Encoder(nn.Module):
    """An LSTM over the source; its final state starts the decoder."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)

    def forward(self, value: dict[str, Any]) -> dict[str, Any]:
        memory, state = self.lstm(value["memory"])
        return {**value, "memory": memory, "state": state}


class Decoder(nn.Module):
    """An LSTM over the decoder's input, started from the encoder's final state."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.scale = hidden**-0.5

    def forward(self, value: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor, float]:
        decoded, _ = self.lstm(value["stream"], value["state"])
        return value["memory"], decoded, value["source"], self.scale


class Attention(nn.Module):
    """Dot-product attention of each decoder step over the source's non-padding positions;
    returns the decoder's state and its context side by side."""

    def forward(self, value: tuple[Tensor, Tensor, Tensor, float]) -> Tensor:
        memory, decoded, source, scale = value
        scores = decoded @ memory.transpose(1, 2) * scale
        scores = scores.masked_fill((source == PAD).unsqueeze(1), float("-inf"))
        context = torch.softmax(scores, dim=-1) @ memory
        return torch.cat([decoded, context], dim=-1)


class TokenSequenceModel(LightningModule):
    """A LightningModule over batches ``(first input, second input, target tokens)``: the
    pipeline takes the two inputs as one tuple and returns logits over ``self.vocab`` tokens,
    scored by token cross-entropy with the padding token ignored. Subclasses build the layers,
    list them in ``configure_pipeline`` and set ``vocab`` and ``lr``."""

    data_kind = "sequences"  # pl-pipedream-train pairs it with data=sequences
    vocab: int
    lr: float

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        return self.configure_pipeline()(inputs)

    def configure_pipeline(self) -> nn.Sequential:
        """The model's layers in order, for ``PipeDreamStrategy`` (each subclass lists its own)."""
        raise NotImplementedError(
            f"a TokenSequenceModel lists its layers (model: {type(self).__name__}); define "
            "configure_pipeline(self) returning nn.Sequential(layer1, layer2, ...)"
        )

    def pipeline_split_batch(self, batch: Any) -> tuple[tuple[Tensor, Tensor], Tensor]:
        first, second, target = batch
        return (first, second), target

    def loss(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, self.vocab), target.reshape(-1), ignore_index=PAD)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, target = self.pipeline_split_batch(batch)
        return self.loss(self(inputs), target)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, target = self.pipeline_split_batch(batch)
        self.log("val_loss", self.loss(self(inputs), target), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Seq2Seq(TokenSequenceModel):
    """Sequence-to-sequence over tokens: embed, encode, decode, attend, score the vocabulary.

    Args:
        input_shape: ``(length,)``, the length of a padded sequence (the data says it).
        num_classes: the vocabulary size, padding and start tokens included.
        hidden: width of the embeddings and of both LSTMs.
        optimizer: ``"sgd"`` or ``"adam"``; lr, momentum: its settings.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        hidden: int = 16,
        optimizer: str = "adam",
        lr: float = 1e-2,
        momentum: float = 0.0,
    ) -> None:
        super().__init__()
        if optimizer not in ("sgd", "adam"):
            raise ValueError(
                f"optimizer must be one of sgd, adam (optimizer: {optimizer!r}); for example "
                "model.optimizer=sgd"
            )
        self.save_hyperparameters()
        self.length = int(input_shape[0])
        self.vocab = int(num_classes)
        self.optimizer_name, self.lr, self.momentum = optimizer, float(lr), float(momentum)
        self.embed = Embed(self.vocab, hidden)
        self.encoder = Encoder(hidden)
        self.decoder = Decoder(hidden)
        self.attention = Attention()
        self.head = nn.Linear(2 * hidden, self.vocab)
        tokens = torch.full((2, self.length), START + 1)
        self.example_input_array = ((tokens, tokens),)  # model(*example): one tuple argument

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.embed, self.encoder, self.decoder, self.attention, self.head)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        tokens, _ = self.pipeline_split_batch(batch)
        return self(tokens).argmax(dim=-1)

    def _evaluate(self, batch: Any, prefix: str) -> None:
        tokens, target = self.pipeline_split_batch(batch)
        logits = self(tokens)
        real = target != PAD
        accuracy = (logits.argmax(dim=-1) == target)[real].float().mean()
        self.log(f"{prefix}_loss", self.loss(logits, target), prog_bar=True)
        self.log(f"{prefix}_acc", accuracy, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return torch.optim.Adam(self.parameters(), lr=self.lr)
