"""GNMT-8 and GNMT-16: parameter counts by formula, layer structure, shapes, pipeline = forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pl_pipedream.models.gnmt import GNMT, GNMT8, GNMT16
from pl_pipedream.models.seq2seq import PAD, START

VOCAB, BATCH, LENGTH = 32000, 3, 5


def lstm(inputs: int, hidden: int) -> int:
    """One LSTM direction: four gates, input and recurrent weights, two biases."""
    return 4 * hidden * (inputs + hidden) + 2 * 4 * hidden


def gnmt_count(layers: int, vocab: int, h: int = 1024) -> int:
    side = layers // 2
    embeddings = 2 * vocab * h
    encoder = 2 * lstm(h, h) + lstm(2 * h, h) + (side - 2) * lstm(h, h)
    decoder = lstm(h, h) + (side - 1) * lstm(2 * h, h)
    attention = 2 * h * h + h
    head = h * vocab + vocab
    return embeddings + encoder + decoder + attention + head


@pytest.mark.parametrize(("cls", "layers"), [(GNMT8, 8), (GNMT16, 16)])
def test_full_size_parameter_counts_follow_the_formula(cls: type[GNMT], layers: int) -> None:
    with torch.device("meta"):
        net = cls((LENGTH,), VOCAB)
    assert sum(p.numel() for p in net.parameters()) == gnmt_count(layers, VOCAB)
    lstms = [m for m in net.modules() if isinstance(m, torch.nn.LSTM)]
    assert len(lstms) == layers
    assert lstms[0].bidirectional and not any(m.bidirectional for m in lstms[1:])
    assert all(m.hidden_size == 1024 for m in lstms)


@pytest.mark.parametrize("layers", [8, 16])
def test_one_pipeline_layer_per_lstm_layer_plus_embedding_attention_head(layers: int) -> None:
    net = GNMT((LENGTH,), 11, layers=layers, scale=128)
    names = [type(layer).__name__ for layer in net.configure_pipeline()]
    side = layers // 2
    expected = ["Embed"] + ["EncoderLayer"] * side + ["DecoderFirst", "Attention"]
    assert names == expected + ["DecoderLayer"] * (side - 1) + ["Head"]
    lstm_layers = [layer for layer in net.configure_pipeline() if hasattr(layer, "lstm")]
    assert len(lstm_layers) == layers
    residual = [getattr(layer, "residual", False) for layer in lstm_layers]
    # encoder: residual from its third layer; decoder: from its third layer
    assert residual == [False, False] + [True] * (side - 2) + [False, False] + [True] * (side - 2)


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    source = torch.tensor([[2, 3, 4, 0, 0], [5, 6, 7, 8, 9], [9, 8, 0, 0, 0]])
    target = torch.tensor([[4, 3, 2, 0, 0], [9, 8, 7, 6, 5], [8, 9, 0, 0, 0]])
    decoder_input = torch.cat([torch.full((BATCH, 1), START), target[:, :-1]], dim=1)
    return source, decoder_input, target


def test_tiny_build_shapes_pipeline_equals_forward_and_loss() -> None:
    torch.manual_seed(0)
    net = GNMT8((LENGTH,), 10, scale=128)  # hidden 8
    source, decoder_input, target = batch()
    logits = net((source, decoder_input))
    assert logits.shape == (BATCH, LENGTH, 10)
    assert torch.equal(net.configure_pipeline()((source, decoder_input)), logits)
    real = target != PAD
    expected = F.cross_entropy(logits[real], target[real])
    assert torch.allclose(net.training_step((source, decoder_input, target), 0), expected)


def test_the_boundaries_carry_dicts_then_tuples_and_attention_ignores_padding() -> None:
    torch.manual_seed(0)
    net = GNMT8((LENGTH,), 10, scale=128)
    source, decoder_input, _ = batch()
    value = net.embed((source, decoder_input))
    for layer in net.encoder:
        value = layer(value)
    assert value["memory"].shape == (BATCH, LENGTH, 8) and value["source"] is source
    value = net.decoder_first(value)
    stream, context = net.attention(value)
    assert stream.shape == context.shape == (BATCH, LENGTH, 8)
    changed = value["memory"].clone()
    changed[0, 3:] += 100.0  # the first example's padded positions
    _, other = net.attention({**value, "memory": changed})
    assert torch.allclose(context, other)
    out = net.decoder[0]((stream, context))
    assert isinstance(out, tuple) and out[1] is context


def test_bad_layer_counts_and_scales_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"\(layers: 7\); use 8"):
        GNMT((LENGTH,), 10, layers=7)
    with pytest.raises(ValueError, match=r"\(scale: 3\)"):
        GNMT((LENGTH,), 10, scale=3)


@pytest.mark.parametrize(("cls", "layers"), [(GNMT8, 8), (GNMT16, 16)])
def test_the_saved_hyperparameters_rebuild_the_model(cls: type[GNMT], layers: int) -> None:
    net = cls((LENGTH,), 10, scale=128)
    assert net.hparams["layers"] == layers
    again = cls(**net.hparams)
    assert len(again.configure_pipeline()) == len(net.configure_pipeline()) == layers + 3
    with pytest.raises(ValueError, match=rf"has {layers} LSTM layers \(layers: 12\)"):
        cls((LENGTH,), 10, layers=12)
