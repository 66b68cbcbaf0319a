"""PennTreebankDataModule: <eos>-closed word streams, the vocabulary, windows, fallback, errors."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pl_pipedream.data.ptb import EOS, UNK, PennTreebankDataModule
from pl_pipedream.models import AWDLM, CharGPT

TRAIN = "the cat sat\nthe <unk> ran\na cat\n"  # 3 + 3 + 2 words, 3 <eos>: 11 tokens


@pytest.fixture
def ptb(tmp_path: Path) -> Path:
    (tmp_path / "ptb.train.txt").write_text(TRAIN, encoding="utf-8")
    (tmp_path / "ptb.valid.txt").write_text("the dog sat\n", encoding="utf-8")
    (tmp_path / "ptb.test.txt").write_text("a cat ran\n", encoding="utf-8")
    return tmp_path


def test_windows_are_consecutive_ids_and_their_targets_the_next_ids(ptb: Path) -> None:
    data = PennTreebankDataModule(str(ptb), length=3, vocab_size=6, batch_size=1)
    data.setup("fit")
    # counts: the 2, cat 2, then sat, ran, a once each; 4 fit beside <eos> and <unk>
    assert data.vocabulary == {"<eos>": 0, "<unk>": 1, "the": 2, "cat": 3, "sat": 4, "ran": 5}
    stream = [2, 3, 4, EOS, 2, UNK, 5, EOS, UNK, 3, EOS]  # "a" is out of the vocabulary
    train = data.splits["train"]
    assert len(train) == (len(stream) - 1) // 3 == 3
    for index in range(3):
        tokens, targets = train[index]
        assert tokens.tolist() == stream[3 * index : 3 * index + 3]
        assert targets.tolist() == stream[3 * index + 1 : 3 * index + 4]
    assert [t.tolist() for t in data.splits["val"][0]] == [[2, UNK, 4], [UNK, 4, EOS]]
    assert [t.tolist() for t in data.splits["test"][0]] == [[UNK, 3, 5], [3, 5, EOS]]
    assert (data.input_shape, data.num_classes, data.data_kind) == ((3,), 6, "text")


def test_without_a_path_a_word_stream_is_generated_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="pl_pipedream.data.ptb"):
        data = PennTreebankDataModule(length=5, vocab_size=30, num_examples=50, batch_size=4)
        data.setup("fit")
    assert [r.message.count("data.path is not set") for r in caplog.records] == [1]
    inputs, targets = data.tensors()
    assert inputs.shape == targets.shape == (50, 5) and inputs.max() < 30
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next words
    assert torch.equal(inputs[1:, 0], targets[:-1, -1])  # windows follow each other


def test_missing_files_and_short_splits_are_refused_naming_the_fix(ptb: Path) -> None:
    (ptb / "ptb.test.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"test split needs ptb.test.txt .*data.path"):
        PennTreebankDataModule(str(ptb))
    (ptb / "ptb.test.txt").write_text("a\n", encoding="utf-8")
    with pytest.raises(ValueError, match="test split must be longer than one window"):
        PennTreebankDataModule(str(ptb), length=3, batch_size=1).setup("fit")


def test_the_language_models_take_a_batch(ptb: Path) -> None:
    data = PennTreebankDataModule(str(ptb), length=3, vocab_size=10, batch_size=2)
    data.setup("fit")
    tokens, targets = next(iter(data.train_dataloader()))
    awd = AWDLM(data.input_shape, data.num_classes, scale=50)
    assert awd(tokens).shape == (2, 3, 10)
    gpt = CharGPT(data.input_shape, data.num_classes)
    assert gpt(tokens).shape == (2, 3, 10)
    for net in (awd, gpt):
        assert torch.isfinite(net.training_step((tokens, targets), 0))
