"""The Seq2Seq example: its layers, what crosses each boundary, and its Lightning steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pl_pipedream.models.seq2seq import PAD, START, Seq2Seq

BATCH, LENGTH, VOCAB = 3, 5, 10


def tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    source = torch.tensor([[2, 3, 4, 0, 0], [5, 6, 7, 8, 9], [9, 8, 0, 0, 0]])
    target = torch.tensor([[4, 3, 2, 0, 0], [9, 8, 7, 6, 5], [8, 9, 0, 0, 0]])
    decoder_input = torch.cat([torch.full((BATCH, 1), START), target[:, :-1]], dim=1)
    return source, decoder_input, target


def test_every_layer_is_a_submodule_and_the_pipeline_is_the_forward() -> None:
    torch.manual_seed(0)
    net = Seq2Seq((LENGTH,), VOCAB, hidden=6)
    layers = net.configure_pipeline()
    assert [type(layer).__name__ for layer in layers] == [
        "Embed",
        "Encoder",
        "Decoder",
        "Attention",
        "Linear",
    ]
    assert all(any(layer is m for m in net.modules()) for layer in layers)
    source, decoder_input, _ = tokens()
    assert torch.equal(net((source, decoder_input)), layers((source, decoder_input)))


def test_the_boundaries_carry_several_tensors_none_and_plain_values() -> None:
    net = Seq2Seq((LENGTH,), VOCAB, hidden=6)
    source, decoder_input, _ = tokens()
    embedded = net.embed((source, decoder_input))
    assert embedded["state"] is None and embedded["source"] is source
    assert embedded["memory"].shape == embedded["stream"].shape == (BATCH, LENGTH, 6)
    encoded = net.encoder(embedded)
    h, c = encoded["state"]
    assert h.shape == c.shape == (1, BATCH, 6)
    memory, decoded, carried, scale = net.decoder(encoded)
    assert carried.dtype == torch.int64 and isinstance(scale, float) and scale == 6**-0.5
    attended = net.attention((memory, decoded, carried, scale))
    assert attended.shape == (BATCH, LENGTH, 12)


def test_attention_ignores_the_padding_of_the_source() -> None:
    net = Seq2Seq((LENGTH,), VOCAB, hidden=6)
    source, decoder_input, _ = tokens()
    memory, decoded, carried, scale = net.decoder(net.encoder(net.embed((source, decoder_input))))
    changed = memory.clone()
    changed[0, 3:] += 100.0  # padded positions of the first example
    first = net.attention((memory, decoded, carried, scale))
    second = net.attention((changed, decoded, carried, scale))
    assert torch.allclose(first, second)


def test_the_loss_is_cross_entropy_over_real_tokens_and_steps_see_the_split_batch() -> None:
    torch.manual_seed(0)
    net = Seq2Seq((LENGTH,), VOCAB, hidden=6)
    batch = tokens()
    (source, decoder_input), target = net.pipeline_split_batch(batch)
    logits = net((source, decoder_input))
    real = target != PAD
    expected = F.cross_entropy(logits[real], target[real])
    assert torch.allclose(net.training_step(batch, 0), expected)
    assert net.predict_step(batch, 0).shape == (BATCH, LENGTH)


def test_an_unknown_optimizer_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"\(optimizer: 'lbfgs'\); for example model.optimizer"):
        Seq2Seq((LENGTH,), VOCAB, optimizer="lbfgs")
