"""``reproduce.profiles``: a paper model profiled here, with exact bytes, cached on disk."""

from __future__ import annotations

import math

import pytest

from pl_pipedream.reproduce.profiles import CACHE_VERSION, MODELS, gemm_gflops, own_profile


@pytest.fixture(scope="module")
def alexnet_cache(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """AlexNet profiled once into a fresh cache folder (about a second): (profile, hit, folder)."""
    folder = tmp_path_factory.mktemp("profiles")
    profile, hit = own_profile("AlexNet", folder)
    return profile, hit, folder


def test_alexnet_is_profiled_once_then_read_from_the_cache(alexnet_cache) -> None:  # type: ignore[no-untyped-def]
    first, hit, folder = alexnet_cache
    assert not hit and (folder / "alexnet.json").is_file()
    # Exact bytes from shapes: torchvision's AlexNet has 61,100,840 fp32 parameters; the first
    # convolution's output is 64 x 55 x 55 floats for one 224 x 224 image.
    assert math.fsum(n.parameter_bytes for n in first.nodes) == 4 * 61_100_840
    assert first.nodes[0].activation_bytes == (4 * 64 * 55 * 55,)
    assert all(n.forward_ms > 0 for n in first.nodes)
    assert first.meta["input"] == MODELS["AlexNet"].shape
    second, hit = own_profile("AlexNet", folder)
    assert hit and second == first


def test_a_stale_cache_file_is_measured_again(alexnet_cache, tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = (alexnet_cache[2] / "alexnet.json").read_text()  # a copy: the shared file stays
    assert f'"cache": "{CACHE_VERSION}"' in text
    (tmp_path / "alexnet.json").write_text(
        text.replace(f'"cache": "{CACHE_VERSION}"', '"cache": "0"')
    )
    _, hit = own_profile("AlexNet", tmp_path)
    assert not hit


def test_an_unknown_model_names_the_known_ones(tmp_path) -> None:
    with pytest.raises(KeyError, match="VGG-16"):
        own_profile("VGG-19", tmp_path)


def test_the_gemm_rate_is_a_positive_rate() -> None:
    assert gemm_gflops(size=128, repeats=2) > 0
