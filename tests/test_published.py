"""pl_pipedream.published: profiles and Table 1 cells ship as package resources, licence beside."""

from __future__ import annotations

import configparser
from importlib.resources import files
from pathlib import Path

import pytest

import pl_pipedream.published as published
from pl_pipedream.profile.graph import ProfileError
from pl_pipedream.reproduce.table import PROFILE_OF, read_table

REPO = Path(__file__).resolve().parents[1]
NAMES = ["alexnet", "densenet121", "gnmt", "gnmt_large", "inception_v3", "resnet18", "resnet50"]
NAMES += ["resnext50", "squeezenet1_0", "vgg16"]


def test_the_profiles_and_the_table_are_resources_of_the_package() -> None:
    root = files("pl_pipedream.published")
    assert published.profile_names() == NAMES
    assert set(PROFILE_OF.values()) <= set(NAMES)  # every profile reproduce plans from
    for name in NAMES:
        assert (
            published.profile_file(name).read_text()
            == (root / "profiles" / f"{name}.txt").read_text()
        )
        assert published.load_profile(name).nodes
    assert (root / "table1.csv").read_text() == published.table1_text()
    assert read_table()[0].id == "vgg16_A_4x4"


def test_pipedreams_licence_and_the_sources_are_beside_the_files() -> None:
    root = files("pl_pipedream.published")
    licence = (root / "profiles" / "LICENSE.txt").read_text()
    assert licence.startswith("MIT License") and "Microsoft Corporation" in licence
    readme = (root / "README.md").read_text()
    assert "github.com/msr-fiddle/pipedream" in readme and "SOSP 2019" in readme


def test_an_unknown_profile_names_the_published_ones() -> None:
    with pytest.raises(ProfileError, match=r"\(profile: vgg19\); pick from alexnet, densenet121"):
        published.load_profile("vgg19")


def test_setup_cfg_ships_every_file_of_the_folder() -> None:
    """A non-editable ``pip install .`` copies only what ``package_data`` names."""
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    patterns = setup["options.package_data"]["pl_pipedream.published"].split(",")
    folder = REPO / "pl_pipedream" / "published"
    shipped = {path for pattern in patterns for path in folder.glob(pattern.strip())}
    data = {
        path for path in folder.rglob("*") if path.is_file() and path.suffix not in (".py", ".pyc")
    }
    assert data and shipped == data
