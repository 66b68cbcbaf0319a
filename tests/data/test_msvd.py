"""MSVDDataModule: .npy frame features and captions, splits, the vocabulary, fallback, errors."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from pl_pipedream.data.msvd import END, PAD, START, UNK, MSVDDataModule, fit_frames
from pl_pipedream.models import S2VT

FRAMES, FEATURES = 4, 3
CAPTIONS = """vid1\tA man plays a guitar.
vid1\ta man is playing
vid2\tA dog runs!
vid10\tthe dog's ball
vid3\ta cat
vid3\ta man
nofeatures\ta man
"""


def features(video: int, frames: int) -> np.ndarray:
    return (100 * video + np.arange(frames * FEATURES).reshape(frames, FEATURES)).astype(np.float32)


@pytest.fixture
def msvd(tmp_path: Path) -> Path:
    (tmp_path / "features").mkdir()
    for video, frames in ((1, 7), (2, 2), (3, 4), (10, 4)):
        np.save(tmp_path / "features" / f"vid{video}.npy", features(video, frames))
    (tmp_path / "captions.txt").write_text(CAPTIONS, encoding="utf-8")
    return tmp_path


def module(root: Path, **overrides: object) -> MSVDDataModule:
    arguments = {
        "frames": FRAMES,
        "feature_size": FEATURES,
        "caption_length": 5,
        "vocab_size": 8,
        "train_videos": 2,
        "val_videos": 1,
        "batch_size": 1,
    }
    return MSVDDataModule(str(root), **{**arguments, **overrides})


def test_frames_are_sampled_evenly_or_padded_with_zeros() -> None:
    long = features(1, 7)
    assert torch.equal(fit_frames(long, 4), torch.from_numpy(long[[0, 2, 4, 6]]))
    short = fit_frames(features(2, 2), 4)
    assert torch.equal(short[:2], torch.from_numpy(features(2, 2))) and not short[2:].any()


def test_each_caption_is_an_example_of_its_videos_features_split_in_natural_order(
    msvd: Path,
) -> None:
    data = module(msvd)
    data.setup("fit")
    # natural order vid1, vid2, vid3, vid10: train vid1 + vid2, val vid3, test vid10
    # training words: a 3, man 2, then first seen: plays, guitar (8 ids in all)
    assert data.vocabulary == {
        "<pad>": 0,
        "<s>": 1,
        "</s>": 2,
        "<unk>": 3,
        "a": 4,
        "man": 5,
        "plays": 6,
        "guitar": 7,
    }
    train = data.splits["train"]
    assert len(train) == 3 and len(data.splits["val"]) == 2 and len(data.splits["test"]) == 1
    frames, caption_input, target = train[0]  # "A man plays a guitar." cut to 4 words
    assert torch.equal(frames, torch.from_numpy(features(1, 7)[[0, 2, 4, 6]]))
    assert target.tolist() == [4, 5, 6, 4, END]
    assert caption_input.tolist() == [START, 4, 5, 6, 4]
    frames, _, target = train[1]  # "a man is playing"
    assert target.tolist() == [4, 5, UNK, UNK, END] and frames[0, 0] == 100
    frames, caption_input, target = train[2]  # vid2: "A dog runs!", 2 frames padded
    assert (
        target.tolist() == [4, UNK, UNK, END, PAD] and frames[0, 0] == 200 and not frames[2:].any()
    )
    assert [t.tolist() for t in data.splits["val"][1][1:]] == [
        [START, 4, 5, END, PAD],
        [4, 5, END, PAD, PAD],
    ]
    assert data.splits["test"][0][2].tolist() == [UNK, UNK, UNK, END, PAD]  # the, dog's, ball
    assert (data.input_shape, data.num_classes, data.data_kind) == ((4, 3), 8, "video")


def test_a_splits_file_decides_the_split(msvd: Path) -> None:
    (msvd / "splits.txt").write_text(
        "vid10\ttrain\nvid3\ttrain\nvid2\tval\nvid1\ttest\n", encoding="utf-8"
    )
    data = module(msvd)
    data.setup("fit")
    assert [int(data.splits["train"][i][0][0, 0]) for i in range(3)] == [1000, 300, 300]
    assert len(data.splits["val"]) == 1 and len(data.splits["test"]) == 2


def test_without_a_path_videos_are_generated_with_their_topics_captions_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="pl_pipedream.data.msvd"):
        data = MSVDDataModule(
            frames=5,
            feature_size=6,
            caption_length=7,
            vocab_size=20,
            num_examples=60,
            topics=3,
            batch_size=4,
        )
        data.setup("fit")
    assert [r.message.count("data.path is not set") for r in caplog.records] == [1]
    frames, caption_input, target = next(iter(data.train_dataloader()))
    assert frames.shape == (4, 5, 6) and target.shape == caption_input.shape == (4, 7)
    assert torch.equal(caption_input[:, 1:], target[:, :-1]) and torch.all(
        caption_input[:, 0] == START
    )
    assert torch.all((target == END).sum(dim=1) == 1) and target.max() < 20
    # videos of one topic share the caption and, up to noise, the features
    videos = data.splits["train"]
    by_caption: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for index in range(len(videos)):
        frames, _, target = videos[index]
        by_caption.setdefault(tuple(target.tolist()), []).append(frames.mean(dim=0))
    assert len(by_caption) == 3
    means = [torch.stack(group).mean(dim=0) for group in by_caption.values()]
    assert min(float((a - b).norm()) for i, a in enumerate(means) for b in means[i + 1 :]) > 1.0


def test_missing_files_empty_splits_and_wrong_widths_are_refused_naming_the_fix(msvd: Path) -> None:
    with pytest.raises(FileNotFoundError, match="features/<video_id>.npy and captions.txt"):
        module(msvd / "nowhere")
    with pytest.raises(ValueError, match="test split has no videos .*data.train_videos"):
        module(msvd, train_videos=3, val_videos=1).setup("fit")
    data = module(msvd, feature_size=5)
    data.setup("fit")
    with pytest.raises(ValueError, match="set data.feature_size to the features' width"):
        data.splits["train"][0]


def test_s2vt_takes_a_batch(msvd: Path) -> None:
    data = module(msvd, batch_size=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    net = S2VT(data.input_shape, data.num_classes, scale=100, caption_length=5)
    inputs, _ = net.pipeline_split_batch(batch)
    assert net(inputs).shape == (2, 5, 8)
    assert torch.isfinite(net.training_step(batch, 0))
