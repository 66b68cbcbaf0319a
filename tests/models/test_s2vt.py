"""S2VT: parameter count by formula, two LSTM layers, the two stages' padding, shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pl_pipedream.models.s2vt import PAD, S2VT

FRAMES, FEATURES, CAPTION, VOCAB = 4, 6, 3, 9


def lstm(inputs: int, hidden: int) -> int:
    return 4 * hidden * (inputs + hidden) + 2 * 4 * hidden


def test_full_size_parameter_count_follows_the_formula() -> None:
    vocab, features = 12_594, 4096  # fc7 features; the vocabulary size is only an example
    with torch.device("meta"):
        net = S2VT((80, features), vocab)
    expected = (
        features * 500 + 500  # frame embedding
        + vocab * 500  # word embedding
        + lstm(500, 1000)
        + lstm(1000 + 500, 1000)
        + 1000 * vocab + vocab  # softmax layer
    )  # fmt: skip
    assert sum(p.numel() for p in net.parameters()) == expected
    lstms = [m for m in net.modules() if isinstance(m, torch.nn.LSTM)]
    assert [(m.input_size, m.hidden_size) for m in lstms] == [(500, 1000), (1500, 1000)]


def test_one_pipeline_layer_per_lstm_layer_plus_embedding_and_head() -> None:
    net = S2VT((FRAMES, FEATURES), VOCAB, scale=100)
    names = [type(layer).__name__ for layer in net.configure_pipeline()]
    assert names == ["Embed", "FirstLSTM", "SecondLSTM", "Linear"]
    assert sum(hasattr(layer, "lstm") for layer in net.configure_pipeline()) == 2


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    features = torch.randn(2, FRAMES, FEATURES)
    target = torch.tensor([[4, 5, 0], [6, 7, 8]])
    caption = torch.tensor([[1, 4, 5], [1, 6, 7]])
    return features, caption, target


def test_each_stream_is_padded_with_zeros_over_the_other_stage() -> None:
    torch.manual_seed(0)
    net = S2VT((FRAMES, FEATURES), VOCAB, scale=100)  # hidden 10, embedding 5
    features, caption, _ = batch()
    value = net.embed((features, caption))
    assert value["caption"] == CAPTION and isinstance(value["caption"], int)
    assert value["stream"].shape == value["words"].shape == (2, FRAMES + CAPTION, 5)
    assert torch.equal(value["stream"][:, FRAMES:], torch.zeros(2, CAPTION, 5))
    assert torch.equal(value["words"][:, :FRAMES], torch.zeros(2, FRAMES, 5))
    assert torch.allclose(value["stream"][:, :FRAMES], net.embed.frames(features))
    assert net.first(value)["stream"].shape == (2, FRAMES + CAPTION, 10)


def test_tiny_build_shapes_pipeline_equals_forward_and_loss() -> None:
    torch.manual_seed(0)
    net = S2VT((FRAMES, FEATURES), VOCAB, scale=100)
    features, caption, target = batch()
    logits = net((features, caption))
    assert logits.shape == (2, CAPTION, VOCAB)
    assert torch.equal(net.configure_pipeline()((features, caption)), logits)
    real = target != PAD
    expected = F.cross_entropy(logits[real], target[real])
    assert torch.allclose(net.training_step((features, caption, target), 0), expected)


def test_the_caption_depends_on_the_frames() -> None:
    torch.manual_seed(0)
    net = S2VT((FRAMES, FEATURES), VOCAB, scale=100)
    features, caption, _ = batch()
    assert not torch.allclose(net((features, caption)), net((features + 1.0, caption)))


def test_bad_shapes_and_scales_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"\(input_shape: \[4096\]\); e.g. \[80, 4096\]"):
        S2VT((4096,), VOCAB)
    with pytest.raises(ValueError, match=r"\(scale: 3\)"):
        S2VT((FRAMES, FEATURES), VOCAB, scale=3)
