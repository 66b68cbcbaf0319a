"""AWD-LM: the paper's 24M parameters by formula, the tie, its layers, shapes, the dropouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pl_pipedream.models.awd_lm import AWDLM

LENGTH = 6


def lstm(inputs: int, hidden: int) -> int:
    return 4 * hidden * (inputs + hidden) + 2 * 4 * hidden


def test_full_size_parameter_count_is_the_papers_24m_on_the_penn_treebank() -> None:
    vocab = 10_000
    with torch.device("meta"):
        net = AWDLM((LENGTH,), vocab)
    expected = vocab * 400 + lstm(400, 1150) + lstm(1150, 1150) + lstm(1150, 400) + vocab
    assert sum(p.numel() for p in net.parameters()) == expected  # the tie is counted once
    assert round(expected / 1e6) == 24  # AWD-LSTM paper, Table 1: 24M
    assert [(m.lstm.input_size, m.lstm.hidden_size) for m in net.lstms] == [
        (400, 1150),
        (1150, 1150),
        (1150, 400),
    ]


def test_the_softmax_weight_is_the_embedding_weight() -> None:
    net = AWDLM((LENGTH,), 50, scale=50)
    assert net.head.weight is net.embed.table.weight
    names = [name for name, _ in net.named_parameters()]
    assert "head.weight" not in names and "embed.table.weight" in names


def test_one_pipeline_layer_per_lstm_layer_plus_embedding_and_head() -> None:
    net = AWDLM((LENGTH,), 50, scale=50)
    layers = list(net.configure_pipeline())
    assert [type(layer).__name__ for layer in layers] == [
        "Embed",
        "WeightDropLSTM",
        "WeightDropLSTM",
        "WeightDropLSTM",
        "Linear",
    ]
    assert sum(isinstance(m, torch.nn.LSTM) for m in net.modules()) == 3


def test_tiny_build_shapes_pipeline_equals_forward_and_loss() -> None:
    torch.manual_seed(0)
    net = AWDLM((LENGTH,), 50, scale=50).eval()
    tokens = torch.randint(0, 50, (3, LENGTH))
    targets = torch.randint(0, 50, (3, LENGTH))
    logits = net(tokens)
    assert logits.shape == (3, LENGTH, 50)
    assert torch.equal(net.configure_pipeline()(tokens), logits)
    expected = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1))
    assert torch.allclose(net.training_step((tokens, targets), 0), expected)


def test_dropouts_act_in_training_only_and_leave_the_weights_alone() -> None:
    torch.manual_seed(0)
    net = AWDLM((LENGTH,), 50, scale=50)
    tokens = torch.randint(0, 50, (3, LENGTH))
    before = net.lstms[0].lstm.weight_hh_l0.clone()
    with torch.random.fork_rng():
        first = net(tokens)
    with torch.random.fork_rng():
        again = net(tokens)
    assert torch.equal(first, again)  # same RNG state, same masks
    assert not torch.allclose(first, net.eval()(tokens))
    assert torch.equal(net.lstms[0].lstm.weight_hh_l0, before)
    quiet = AWDLM((LENGTH,), 50, scale=50, dropoute=0, dropouti=0, dropouth=0, dropout=0, wdrop=0)
    quiet.load_state_dict(net.state_dict())
    assert torch.allclose(quiet.train()(tokens), net.eval()(tokens))


def test_locked_dropout_shares_one_mask_across_time() -> None:
    torch.manual_seed(0)
    net = AWDLM((LENGTH,), 50, scale=50, dropoute=0, dropouti=0.5, wdrop=0)
    vectors = net.embed(torch.full((4, LENGTH), 7))  # the same word at every step
    zero = vectors == 0
    assert zero.any() and torch.equal(zero, zero[:, :1].expand_as(zero))


def test_a_scale_that_does_not_divide_the_widths_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\(scale: 4\); use one of 1, 2, 5"):
        AWDLM((LENGTH,), 50, scale=4)
