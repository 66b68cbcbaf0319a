"""``GNMT``: Google's neural machine translation model (Wu et al., 2016), as GNMT-8 and GNMT-16.

Written from the GNMT paper's description, at the granularity PipeDream profiled (one pipeline
layer per LSTM layer): an embedding layer (source and target tables), the encoder's LSTM layers
(the first bidirectional, its two directions concatenated; residual connections from the third
layer on), the decoder's first LSTM layer, additive attention of that layer's output over the
encoder's output, the later decoder layers (each fed its predecessor's output and the attention
context; residual connections from the third layer on) and the projection to the vocabulary.
PipeDream's naming counts LSTM layers in all: GNMT-8 has 4 encoder and 4 decoder layers, GNMT-16
8 and 8. Every LSTM has ``hidden`` units (1024 in the paper), the embeddings too; ``scale``
divides both for small builds.

What crosses the boundaries: through the encoder a dict of the source's states (``memory``), the
decoder's input stream and the source tokens (for attention's padding mask); the decoder's first
layer adds its output; attention returns the tuple (stream, context), which every later decoder
layer passes on with its own output as the stream; the head makes one tensor of logits.

Batches are ``(source, decoder input, target)`` token tensors, as ``data.SequenceDataModule``
gives them (token 0 pads, token 1 starts the decoder's input; the loss ignores padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pl_pipedream.models.seq2seq import PAD, START, TokenSequenceModel

__all__ = ["GNMT", "GNMT8", "GNMT16"]

HIDDEN = 1024  # the GNMT paper's LSTM and embedding width


class Embed(nn.Module):
    """Source and target tokens to vectors (a table each)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.source = nn.Embedding(vocab, hidden, padding_idx=PAD)
        self.target = nn.Embedding(vocab, hidden, padding_idx=PAD)

    def forward(self, tokens: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        source, decoder_input = tokens
        return {
            "memory": self.source(source),
            "stream": self.target(decoder_input),
            "source": source,
        }


class EncoderLayer(nn.Module):
    """One encoder LSTM layer: bidirectional (``index`` 1), fed the bidirectional output
    (``index`` 2), or residual (``index`` 3 on)."""

    def __init__(self, hidden: int, index: int) -> None:
        super().__init__()
        self.residual = index >= 3
        if index == 1:
            self.lstm = nn.LSTM(hidden, hidden, batch_first=True, bidirectional=True)
        else:
            self.lstm = nn.LSTM(2 * hidden if index == 2 else hidden, hidden, batch_first=True)

    def forward(self, value: dict[str, Tensor]) -> dict[str, Tensor]:
        out, _ = self.lstm(value["memory"])
        memory = value["memory"] + out if self.residual else out
        return {**value, "memory": memory}


class DecoderFirst(nn.Module):
    """The decoder's first LSTM layer: its output is attention's query."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)

    def forward(self, value: dict[str, Tensor]) -> dict[str, Tensor]:
        out, _ = self.lstm(value["stream"])
        return {**value, "stream": out}


class Attention(nn.Module):
    """Additive attention (``v . tanh(W_q q + W_k k)``) of each decoder step over the source's
    non-padding positions; returns (the decoder's stream, the context)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.key = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Parameter(torch.empty(hidden).uniform_(-(hidden**-0.5), hidden**-0.5))

    def forward(self, value: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        query, memory = value["stream"], value["memory"]
        mixed = self.query(query).unsqueeze(2) + self.key(memory).unsqueeze(1)  # (B, T, S, H)
        scores = torch.tanh(mixed) @ self.v
        scores = scores.masked_fill((value["source"] == PAD).unsqueeze(1), float("-inf"))
        return query, torch.softmax(scores, dim=-1) @ memory


class DecoderLayer(nn.Module):
    """A later decoder LSTM layer over its predecessor's output and the attention context;
    residual from the third decoder layer on."""

    def __init__(self, hidden: int, index: int) -> None:
        super().__init__()
        self.residual = index >= 3
        self.lstm = nn.LSTM(2 * hidden, hidden, batch_first=True)

    def forward(self, value: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        stream, context = value
        out, _ = self.lstm(torch.cat([stream, context], dim=-1))
        return (stream + out if self.residual else out), context


class Head(nn.Module):
    """The last decoder layer's output to scores over the vocabulary."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.out = nn.Linear(hidden, vocab)

    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        return self.out(value[0])


class GNMT(TokenSequenceModel):
    """GNMT with ``layers`` LSTM layers in all, half in the encoder and half in the decoder.

    Args:
        input_shape: ``(length,)``, the length of a padded sequence (the data says it).
        num_classes: the vocabulary size (shared by source and target), padding and start
            tokens included.
        layers: LSTM layers in all, even and at least 4 (8: GNMT-8, 16: GNMT-16).
        scale: divides the hidden and embedding width (1 is the paper's 1024).
        lr: Adam's learning rate.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        layers: int = 8,
        scale: int = 1,
        lr: float = 2e-3,
    ) -> None:
        super().__init__()
        if layers < 4 or layers % 2:
            raise ValueError(
                f"GNMT needs an even number of LSTM layers, at least 4 (layers: {layers}); "
                "use 8 (GNMT-8) or 16 (GNMT-16)"
            )
        if scale < 1 or HIDDEN % scale:
            raise ValueError(
                f"GNMT's scale must divide {HIDDEN} (scale: {scale}); use a power of two"
            )
        self.save_hyperparameters()
        self.length, self.vocab, self.lr = int(input_shape[0]), int(num_classes), float(lr)
        hidden, side = HIDDEN // scale, layers // 2
        self.embed = Embed(self.vocab, hidden)
        self.encoder = nn.ModuleList(EncoderLayer(hidden, i) for i in range(1, side + 1))
        self.decoder_first = DecoderFirst(hidden)
        self.attention = Attention(hidden)
        self.decoder = nn.ModuleList(DecoderLayer(hidden, i) for i in range(2, side + 1))
        self.head = Head(self.vocab, hidden)
        tokens = torch.full((2, self.length), START + 1)
        self.example_input_array = ((tokens, tokens),)  # model(*example): one tuple argument

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(
            self.embed,
            *self.encoder,
            self.decoder_first,
            self.attention,
            *self.decoder,
            self.head,
        )


class GNMT8(GNMT):
    """GNMT-8: 4 encoder and 4 decoder LSTM layers (``layers`` is accepted only as 8, so that
    the saved hyperparameters rebuild it)."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, layers: int = 8, **kwargs: Any
    ) -> None:
        check_named(type(self).__name__, layers, 8)
        super().__init__(input_shape, num_classes, layers=layers, **kwargs)


class GNMT16(GNMT):
    """GNMT-16: 8 encoder and 8 decoder LSTM layers (``layers`` is accepted only as 16)."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, layers: int = 16, **kwargs: Any
    ) -> None:
        check_named(type(self).__name__, layers, 16)
        super().__init__(input_shape, num_classes, layers=layers, **kwargs)


def check_named(name: str, layers: int, fixed: int) -> None:
    if layers != fixed:
        raise ValueError(
            f"{name} has {fixed} LSTM layers (layers: {layers}); use GNMT with "
            f"layers={layers} for another depth"
        )
