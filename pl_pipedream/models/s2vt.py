"""``S2VT``: sequence to sequence video to text (Venugopalan et al., 2015), over precomputed frame
features, pipelined with one layer per LSTM layer.

Written from the paper's description: a linear layer embeds each frame's CNN features (4096-wide
fc7 features in the paper; ``feature_size`` here) to 500 dimensions; a stack of two LSTMs with
1000 units each reads the frames (encoding stage) and then produces the caption (decoding stage)
in one pass over ``frames + caption`` steps. The first LSTM sees the embedded frames, then zeros
(padding) while the caption is decoded; the second LSTM sees the first one's output
concatenated with the embedded previous word (500 dimensions), zeros while the frames are read.
Only the decoding steps are scored, by a softmax layer over the vocabulary.

What crosses the boundaries: the embedding layer returns a dict of the first LSTM's input
stream, the word stream and the caption's length (a Python int); the first LSTM replaces the
stream with its output; the second LSTM returns one tensor, its decoding steps; the head makes
the logits. Batches are ``(frame features (B, F, feature_size), caption input (B, T), caption
target (B, T))``, token 0 padding (the loss ignores it), token 1 starting the caption input.
``scale`` divides the widths (1000 and 500) for small builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pl_pipedream.models.seq2seq import PAD, START, TokenSequenceModel

__all__ = ["S2VT"]

HIDDEN, EMBEDDING = 1000, 500  # the paper's LSTM units and frame/word embedding width


class Embed(nn.Module):
    """Frame features and caption words to the two LSTMs' input streams, each padded with zeros
    over the other stage's steps."""

    def __init__(self, feature_size: int, vocab: int, width: int) -> None:
        super().__init__()
        self.frames = nn.Linear(feature_size, width)
        self.words = nn.Embedding(vocab, width, padding_idx=PAD)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> dict[str, Any]:
        features, caption = inputs
        frames, words = self.frames(features), self.words(caption)
        return {
            "stream": torch.cat([frames, frames.new_zeros(words.shape)], dim=1),
            "words": torch.cat([words.new_zeros(frames.shape), words], dim=1),
            "caption": caption.shape[1],
        }


class FirstLSTM(nn.Module):
    """The first LSTM over the frames (then padding): its output feeds the second."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, hidden, batch_first=True)

    def forward(self, value: dict[str, Any]) -> dict[str, Any]:
        out, _ = self.lstm(value["stream"])
        return {**value, "stream": out}


class SecondLSTM(nn.Module):
    """The second LSTM over the first one's output and the previous word; returns its outputs
    at the decoding steps."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(hidden + width, hidden, batch_first=True)

    def forward(self, value: dict[str, Any]) -> Tensor:
        out, _ = self.lstm(torch.cat([value["stream"], value["words"]], dim=-1))
        return out[:, -value["caption"] :]


class S2VT(TokenSequenceModel):
    """Captions of videos given as frame features.

    Args:
        input_shape: ``(frames, feature_size)`` of one video's features (the data says it).
        num_classes: the caption vocabulary's size, padding and start tokens included.
        scale: divides the LSTM and embedding widths (a divisor of 500; 1 is the paper's).
        lr: Adam's learning rate.
    """

    data_kind = "video"  # frame features and captions

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        scale: int = 1,
        lr: float = 1e-3,
        caption_length: int = 20,
    ) -> None:
        super().__init__()
        if len(input_shape) != 2:
            raise ValueError(
                f"S2VT needs frame features shaped (frames, feature_size) (input_shape: "
                f"{list(input_shape)}); e.g. [80, 4096] for the paper's fc7 features"
            )
        if scale < 1 or EMBEDDING % scale:
            raise ValueError(
                f"S2VT's scale must divide {EMBEDDING} (scale: {scale}); e.g. 1, 10, 50 or 100"
            )
        self.save_hyperparameters()
        self.frames, self.feature_size = int(input_shape[0]), int(input_shape[1])
        self.vocab, self.lr = int(num_classes), float(lr)
        width, hidden = EMBEDDING // scale, HIDDEN // scale
        self.embed = Embed(self.feature_size, self.vocab, width)
        self.first = FirstLSTM(width, hidden)
        self.second = SecondLSTM(width, hidden)
        self.head = nn.Linear(hidden, self.vocab)
        features = torch.zeros(2, self.frames, self.feature_size)
        caption = torch.full((2, int(caption_length)), START)
        self.example_input_array = ((features, caption),)  # model(*example): one tuple argument

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.embed, self.first, self.second, self.head)
