"""WMT16DataModule: parallel text to padded ids, the shared vocabulary, the fallback, errors."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pl_pipedream.data.wmt16 import END, PAD, START, UNK, WMT16DataModule
from pl_pipedream.models import GNMT, Seq2Seq

TRAIN = {
    "en": ["the cat sat", "the dog ran far away", "", "a cat"],
    "de": ["die katze sass", "der hund lief weit weg", "leer", "eine katze"],
}


def write(root: Path, splits: dict[str, dict[str, list[str]]]) -> None:
    for name, languages in splits.items():
        for language, lines in languages.items():
            (root / f"{name}.{language}").write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture
def wmt(tmp_path: Path) -> Path:
    small = {"en": ["the cat", "a bird"], "de": ["die katze", "ein vogel"]}
    write(tmp_path, {"train": TRAIN, "newstest2013": small, "newstest2014": small})
    return tmp_path


def test_sentences_become_ids_of_the_most_frequent_tokens_closed_and_padded(wmt: Path) -> None:
    data = WMT16DataModule(str(wmt), vocab_size=10, length=5, batch_size=1)
    data.setup("fit")
    # counts over both training files, the empty-sided pair dropped: the 2, cat 2, katze 2,
    # then first seen: sat, die, ... ; 6 words fit beside the 4 special tokens
    words = ["the", "cat", "katze", "sat", "die", "sass"]
    assert data.vocabulary == {
        w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])
    }
    assert len(data.splits["train"]) == 3
    source, decoder_input, target = data.splits["train"][1]
    # "the dog ran far away" cut to 4 tokens, then END; dog/ran/far are out of the vocabulary
    assert source.tolist() == [4, UNK, UNK, UNK, END]
    assert target.tolist() == [UNK, UNK, UNK, UNK, END]
    source, decoder_input, target = data.splits["train"][2]
    assert source.tolist() == [UNK, 5, END, PAD, PAD]  # "a cat"
    assert target.tolist() == [UNK, 6, END, PAD, PAD]  # "eine katze"
    assert decoder_input.tolist() == [START, UNK, 6, END, PAD]
    val = data.splits["val"][0]
    assert [t.tolist() for t in val] == [
        [4, 5, END, 0, 0],
        [START, 8, 6, END, 0],
        [8, 6, END, 0, 0],
    ]
    assert (data.input_shape, data.num_classes, data.data_kind) == ((5,), 10, "sequences")


def test_a_vocabulary_file_wins_over_counting(wmt: Path) -> None:
    (wmt / "vocab.txt").write_text("<unk>\nkatze\t7\ncat 9\nthe\n", encoding="utf-8")
    data = WMT16DataModule(str(wmt), vocab_size=6, length=4, batch_size=1)
    data.setup("fit")
    assert data.vocabulary == {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "katze": 4, "cat": 5}
    assert data.splits["train"][0][0].tolist() == [UNK, 5, UNK, END]


def test_without_a_path_the_reversal_task_is_generated_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="pl_pipedream.data.wmt16"):
        data = WMT16DataModule(vocab_size=20, length=6, num_examples=100, batch_size=8)
        data.setup("fit")
    assert [r.message.count("data.path is not set") for r in caplog.records] == [1]
    source, decoder_input, target = next(iter(data.train_dataloader()))
    assert source.shape == target.shape == (8, 6) and source.max() < 20
    count = int((source[0] != PAD).sum())
    assert torch.equal(target[0, :count], source[0, :count].flip(0))


def test_missing_or_uneven_files_are_refused_naming_the_fix(wmt: Path) -> None:
    with pytest.raises(FileNotFoundError, match="directory of parallel text"):
        WMT16DataModule(str(wmt / "nowhere"))
    (wmt / "newstest2014.de").unlink()
    with pytest.raises(FileNotFoundError, match=r"test split needs its de file .*data.test=NAME"):
        WMT16DataModule(str(wmt))
    data = WMT16DataModule(str(wmt), test="newstest2013", batch_size=1)
    (wmt / "train.de").write_text("eins\nzwei\n", encoding="utf-8")
    with pytest.raises(ValueError, match="one line per sentence pair"):
        data.setup("fit")


def test_the_sequence_models_take_a_batch(wmt: Path) -> None:
    data = WMT16DataModule(str(wmt), vocab_size=12, length=6, batch_size=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    for net in (
        Seq2Seq(data.input_shape, data.num_classes, hidden=8),
        GNMT(data.input_shape, data.num_classes, layers=4, scale=128),
    ):
        inputs, _ = net.pipeline_split_batch(batch)
        assert net(inputs).shape == (2, 6, 12)
        assert torch.isfinite(net.training_step(batch, 0))
