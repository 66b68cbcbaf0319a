"""ImageNetDataModule: class folders of images decoded with Pillow, our transforms, the fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pl_pipedream.data.imagenet import MEAN, STD, ImageNetDataModule, random_resized_crop
from pl_pipedream.models import VGG16, ResNet50

SIZE = 28  # the center crop; the shorter side is resized to 28 * 256 / 224 = 32


def pixels(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def normalised(array: np.ndarray) -> torch.Tensor:
    values = (array.astype(np.float64) / 255.0 - np.array(MEAN)) / np.array(STD)
    return torch.tensor(values.transpose(2, 0, 1), dtype=torch.float32)


def write_folders(root: Path, classes: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """Images of 32 x 48 (height x width) pixels per class folder; returns their arrays."""
    arrays = {}
    for seed, (folder, names) in enumerate(classes.items()):
        for index, name in enumerate(names):
            array = pixels(10 * seed + index, 32, 48)
            (root / folder).mkdir(parents=True, exist_ok=True)
            if name.endswith(".txt"):
                (root / folder / name).write_text("not an image")
                continue
            Image.fromarray(array).save(root / folder / name)
            arrays[f"{folder}/{name}"] = array
    return arrays


@pytest.fixture
def imagenet(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    arrays = write_folders(
        tmp_path,
        {
            "train/n01": ["a.png", "b.JPEG"],
            "train/n02": ["c.png", "d.jpg", "notes.txt"],
            "val/n01": ["e.png"],
            "val/n02": ["f.png"],
        },
    )
    return tmp_path, arrays


def test_validation_images_are_center_crops_normalised_with_imagenet_statistics(
    imagenet: tuple[Path, dict[str, np.ndarray]],
) -> None:
    root, arrays = imagenet
    data = ImageNetDataModule(str(root), image_size=SIZE, num_classes=2, batch_size=2)
    data.setup("fit")
    assert (data.classes, data.input_shape, data.data_kind) == (
        ["n01", "n02"],
        (3, 28, 28),
        "images",
    )
    for index, (name, label) in enumerate([("val/n01/e.png", 0), ("val/n02/f.png", 1)]):
        image, target = data.splits["val"][index]
        # 32 rows already match the resized shorter side: the crop is rows 2..29, columns 10..37
        expected = normalised(arrays[name][2:30, 10:38])
        torch.testing.assert_close(image, expected, rtol=0, atol=1e-5)
        assert int(target) == label
    assert len(data.splits["test"]) == 2
    assert len(data.splits["train"]) == 4  # notes.txt is no image


def test_training_images_are_decoded_jpegs_and_pngs_cropped_to_the_image_size(
    imagenet: tuple[Path, dict[str, np.ndarray]],
) -> None:
    root, _ = imagenet
    data = ImageNetDataModule(str(root), image_size=SIZE, num_classes=2, batch_size=2)
    data.setup("fit")
    torch.manual_seed(0)
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (2, 3, SIZE, SIZE) and images.dtype == torch.float32
    low = (0 - torch.tensor(MEAN)) / torch.tensor(STD)
    high = (1 - torch.tensor(MEAN)) / torch.tensor(STD)
    per_channel = images.transpose(0, 1).reshape(3, -1)
    assert torch.all(per_channel >= low[:, None] - 1e-5) and torch.all(
        per_channel <= high[:, None] + 1e-5
    )
    assert sorted(int(data.splits["train"][i][1]) for i in range(4)) == [0, 0, 1, 1]


def test_every_process_draws_the_same_augmented_batches_and_each_epoch_new_ones(
    imagenet: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """Two modules stand for two ranks whose global generators differ (a pipeline checks that
    every rank feeds the same batches); the second uses a worker process."""
    root, _ = imagenet
    epochs = []
    for global_seed, workers in ((1, 0), (2, 1)):
        torch.manual_seed(global_seed)
        data = ImageNetDataModule(
            str(root), image_size=SIZE, num_classes=2, batch_size=4, num_workers=workers
        )
        data.setup("fit")
        loader = data.train_dataloader()
        epochs.append([next(iter(loader)) for _ in range(2)])
    for (first, labels), (again, labels_again) in zip(epochs[0], epochs[1], strict=True):
        assert torch.equal(first, again) and torch.equal(labels, labels_again)
    assert not torch.equal(epochs[0][0][0], epochs[0][1][0])


def test_random_resized_crop_takes_a_region_of_the_drawn_area_and_ratio() -> None:
    array = pixels(3, 40, 40)
    torch.manual_seed(1)
    crop = np.asarray(
        random_resized_crop(Image.fromarray(array), 20, scale=(0.25, 0.25), ratio=(1, 1))
    )
    matches = [
        (top, left)
        for top in range(21)
        for left in range(21)
        if np.array_equal(array[top : top + 20, left : left + 20], crop)
    ]
    assert len(matches) == 1


def test_without_a_path_images_are_generated_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="pl_pipedream.data.imagenet"):
        data = ImageNetDataModule(image_size=32, num_classes=5, num_examples=40, batch_size=8)
        data.setup("fit")
        data.setup("validate")
    assert [r.message.count("data.path is not set") for r in caplog.records] == [1]
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (8, 3, 32, 32) and labels.max() < 5
    again = ImageNetDataModule(image_size=32, num_classes=5, num_examples=40, batch_size=8)
    again.setup("fit")
    assert torch.equal(again.splits["val"][0][0], data.splits["val"][0][0])


def test_bad_folders_are_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train folder of class folders"):
        ImageNetDataModule(str(tmp_path / "nowhere"))
    write_folders(tmp_path, {"train/n01": ["a.png"], "train/n02": ["b.png"]})
    with pytest.raises(FileNotFoundError, match="val folder"):
        ImageNetDataModule(str(tmp_path), num_classes=2)
    write_folders(tmp_path, {"val/n01": ["c.png"], "val/n03": ["d.png"]})
    with pytest.raises(ValueError, match=r"same class folders \(in one only: \['n02', 'n03'\]\)"):
        ImageNetDataModule(str(tmp_path), num_classes=2)
    (tmp_path / "val/n03/d.png").unlink()
    (tmp_path / "val/n03").rmdir()
    (tmp_path / "val/n02").mkdir()
    with pytest.raises(ValueError, match="set data.num_classes=2"):
        ImageNetDataModule(str(tmp_path))
    data = ImageNetDataModule(str(tmp_path), num_classes=2, batch_size=1)
    with pytest.raises(FileNotFoundError, match="val folders hold no images"):
        (tmp_path / "val/n01/c.png").unlink()
        data.setup("fit")


@pytest.mark.parametrize("model", [VGG16, ResNet50])
def test_the_image_models_take_a_batch(
    model: type, imagenet: tuple[Path, dict[str, np.ndarray]]
) -> None:
    root, _ = imagenet
    data = ImageNetDataModule(str(root), image_size=32, num_classes=2, batch_size=2)
    data.setup("fit")
    images, labels = next(iter(data.val_dataloader()))
    net = model(input_shape=data.input_shape, num_classes=data.num_classes, width=64)
    assert net(images).shape == (2, 2)
    assert torch.isfinite(net.training_step((images, labels), 0))
