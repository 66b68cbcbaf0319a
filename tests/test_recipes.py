"""recipes/: one Hydra config per Table 1 row, composed, checked against the table, and run.

Every row of the checked table (``pl_pipedream/published/table1.csv``) and every unchecked row
``pl-pipedream reproduce`` knows has exactly one recipe; each recipe names its row, quotes the
paper's figures only where the checked table has them, pins the row's cluster, servers x GPUs,
sync mode, model and data, refuses to start on this machine (no CUDA device) and, with
``smoke=true``, becomes a 2-process CPU run. One recipe per model runs that smoke run through
``pl-pipedream-train``'s main and the strategy, its two ranks forked from the test (slow).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

from pl_pipedream.apps.train import MachineError, _build_model, apply_smoke, check_machine
from pl_pipedream.reproduce.table import read_table
from tests.apps.test_train import fork_app

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# Table 1's model names -> the model config each recipe must use
MODEL_CONFIG = {
    "VGG-16": "vgg16",
    "AlexNet": "alexnet",
    "ResNet-50": "resnet50",
    "GNMT-8": "gnmt8",
    "GNMT-16": "gnmt16",
    "AWD-LM": "awd_lm",
    "S2VT": "s2vt",
}
DATA_CONFIG = {"vgg16": "imagenet", "alexnet": "imagenet", "resnet50": "imagenet"}
DATA_CONFIG.update(gnmt8="wmt16", gnmt16="wmt16", awd_lm="ptb", s2vt="msvd")
# each cluster's workers per level, innermost first (cluster C: one GPU per server, one level)
CLUSTER_WORKERS = {"A": [4, 4], "B": [8, 2], "C": [4]}


def recipe(name: str, *overrides: str) -> DictConfig:
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        return compose(name, overrides=["output_dir=/tmp/pl-pipedream-recipe", *overrides])


def rows() -> list:
    return read_table()


def names() -> list[str]:
    return sorted(path.stem for path in RECIPES.glob("*.yaml"))


def row_of(name: str):  # type: ignore[no-untyped-def]
    wanted = recipe(name).recipe
    return next(row for row in rows() if row.id == wanted)


def test_every_row_of_table_1_has_one_recipe() -> None:
    named = sorted(recipe(name).recipe for name in names())
    assert named == sorted(row.id for row in rows())
    assert len(named) == 13


@pytest.mark.parametrize("name", names())
def test_a_recipe_pins_its_row(name: str) -> None:
    row = row_of(name)
    cfg = recipe(name)
    model = MODEL_CONFIG[row.model]
    assert name == f"{model}_cluster_{row.cluster.lower()}_{row.servers}x{row.gpus_per_server}"
    assert cfg.model._target_.rsplit(".", 1)[1].lower() == model.replace("_", "")
    data = {"imagenet": "ImageNet", "wmt16": "WMT16", "ptb": "PennTreebank", "msvd": "MSVD"}
    assert cfg.data._target_.endswith(data[DATA_CONFIG[model]] + "DataModule")
    kind = getattr(get_class(cfg.model._target_), "data_kind", "images")
    assert getattr(get_class(cfg.data._target_), "data_kind", "images") == kind
    # the row's cluster: its GPUs per server, and as many servers and GPUs as the row
    topology = instantiate(cfg.cluster.topology)
    assert [level.workers for level in topology.levels] == CLUSTER_WORKERS[row.cluster]
    assert row.servers * row.gpus_per_server <= topology.num_workers
    assert (cfg.trainer.num_nodes, cfg.trainer.devices) == (row.servers, row.gpus_per_server)
    assert cfg.trainer.accelerator == "gpu"
    assert cfg.strategy.sync == "async"  # PipeDream's weight stashing, as the paper ran
    assert cfg.data.batch_size % cfg.strategy.microbatches == 0
    assert cfg.seed == 0 and cfg.smoke is False


@pytest.mark.parametrize("name", names())
def test_a_recipe_quotes_the_paper_only_where_the_checked_table_has_it(name: str) -> None:
    row = row_of(name)
    header = (RECIPES / f"{name}.yaml").read_text().split("defaults:")[0]
    assert header.startswith(f"# Table 1 row {row.id}:")
    quoted = set(re.findall(r"(\d+\.\d+)x", header))
    paper = {f"{value:.2f}" for value in (row.speedup_epoch, row.speedup_tta) if value}
    assert quoted == paper
    if row.config is None:
        assert "not in the checked table" in header
    else:
        assert (
            (f"config {row.config}" in header)
            or (row.config == "straight" and "a straight pipeline" in header)
            or (row.config == "16 (DP)" and "config 16 (data parallelism)" in header)
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("name", names())
def test_a_recipe_refuses_this_machine_unless_smoke(name: str) -> None:
    cfg = recipe(name)
    gpus = cfg.trainer.num_nodes * cfg.trainer.devices
    with pytest.raises(MachineError, match=rf"needs {gpus} GPUs? on .*add smoke=true"):
        check_machine(apply_smoke(cfg), cuda_devices=0, environ={})
    smoke = apply_smoke(recipe(name, "smoke=true"))
    check_machine(smoke, cuda_devices=0, environ={})  # passes
    assert (smoke.trainer.accelerator, smoke.trainer.devices, smoke.trainer.num_nodes) == (
        "cpu",
        2,
        1,
    )
    assert smoke.data.path is None and smoke.trainer.max_steps == 3
    assert sum(smoke.strategy.balance) == len(
        instantiate_small(smoke).configure_pipeline()
    )  # the two stages hold every layer


def instantiate_small(cfg: DictConfig):  # type: ignore[no-untyped-def]
    """The smoke run's model, built from the smoke run's data by the app's own builder."""
    return _build_model(cfg, instantiate(cfg.data))


# one recipe per model: its smoke run through the app and the strategy
SMOKE_RUNS = [
    "vgg16_cluster_a_4x4",
    "alexnet_cluster_b_2x8",
    "resnet50_cluster_a_4x4",
    "gnmt8_cluster_b_2x8",
    "gnmt16_cluster_a_4x4",
    "awd_lm_cluster_a_1x4",
    "s2vt_cluster_c_4x1",
]


def test_the_smoke_runs_cover_every_model() -> None:
    models = {recipe(name).model._target_ for name in SMOKE_RUNS}
    assert len(models) == len(MODEL_CONFIG) and set(SMOKE_RUNS) <= set(names())


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOKE_RUNS)
def test_a_recipe_smoke_run_trains_on_two_stages_and_writes_its_results(
    name: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    done = fork_app(
        f"--config-dir={RECIPES}",
        f"--config-name={name}",
        "smoke=true",
        "++smoke_settings.trainer.enable_progress_bar=false",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=150,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "data.path is not set" in output  # the generated data says so
    results = json.loads((run_dir / "results.json").read_text())
    metrics = results["metrics"]
    assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["val_loss"])
    printed = next(line for line in output.splitlines() if "Final metrics:" in line)
    assert f"val_loss={metrics['val_loss']:.4f}" in printed
    smoke = recipe(name, "smoke=true").smoke_settings
    assert results["plan"]["stages"] == 2
    assert results["plan"]["balance"] == list(smoke.strategy.balance)
    config = results["config"]
    assert config["recipe"] == recipe(name).recipe and config["smoke"] is True
    assert config["trainer"]["max_steps"] == 3 and config["trainer"]["accelerator"] == "cpu"
    assert config["model"] == {**config["model"], **dict(smoke.model)}  # reduced, as merged
