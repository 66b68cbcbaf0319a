"""The Hydra app ``pl-pipedream-train``: every config composes, the pieces build, runs work.

How rank 0 starts the other ranks is tested in test_hydra_ranks.py.

Composition and construction run in-process (no training). The slow tests run the app as a
user would, in a subprocess (the app starts its other ranks by re-running itself, which must not
happen inside pytest), and check what it prints and writes.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import get_class, get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from pl_pipedream import PipeDreamStrategy, Topology
from pl_pipedream.planner.topology import TopologyError
from pl_pipedream.train import _build_model, num_processes, topology_for_devices

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "pl_pipedream" / "configs"
GROUPS = ("data", "model", "cluster", "sync", "trainer")


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIGS / group).glob("*.yaml"))


def composed(*overrides: str, output_dir: str = "/tmp/pl-pipedream-test") -> DictConfig:
    with initialize_config_module("pl_pipedream.configs", version_base="1.3"):
        return compose("train", overrides=[f"output_dir={output_dir}", *overrides])


def test_every_group_has_its_options() -> None:
    assert options("model") == ["cnn", "gpt", "mlp", "seq2seq"]
    assert options("data") == ["digits", "sequences", "synthetic", "text"]
    assert options("cluster") == ["cluster_a", "cluster_b", "cluster_c", "local"]
    assert options("sync") == ["2bw", "async", "flush", "gpipe", "vertical_sync"]
    assert options("trainer") == ["cpu", "gpu"]


def test_every_combination_composes_and_resolves() -> None:
    combinations = list(itertools.product(*(options(group) for group in GROUPS)))
    with initialize_config_module("pl_pipedream.configs", version_base="1.3"):
        for choice in combinations:
            overrides = [f"{group}={option}" for group, option in zip(GROUPS, choice, strict=True)]
            cfg = compose("train", overrides=["output_dir=/tmp/x", *overrides])
            resolved = OmegaConf.to_container(cfg, resolve=True)
            assert isinstance(resolved, dict)
            for node in ("data", "model", "strategy", "trainer"):
                get_class(cfg[node]._target_)
            assert cfg.strategy.sync == choice[GROUPS.index("sync")]
            assert cfg.data.batch_size % cfg.strategy.microbatches == 0
            assert cfg.strategy.timeline == "/tmp/x/timeline.json"
    assert len(combinations) == 4 * 4 * 4 * 5 * 2


def test_defaults_are_the_main_job() -> None:
    cfg = composed()
    assert cfg.data._target_.endswith("DigitsDataModule")
    assert cfg.model._target_.endswith("MLP")
    assert cfg.cluster.topology is None
    assert (cfg.strategy.sync, cfg.strategy.balance) == ("async", None)
    assert (cfg.trainer.accelerator, num_processes(cfg.trainer)) == ("cpu", 2)
    assert cfg.trainer.use_distributed_sampler is False
    assert cfg.trainer.logger.save_dir == "/tmp/pl-pipedream-test"


IMAGE_DATA = [name for name in options("data") if name not in ("sequences", "text")]
IMAGE_MODELS = [name for name in options("model") if name not in ("seq2seq", "gpt")]


@pytest.mark.parametrize("data", IMAGE_DATA)
@pytest.mark.parametrize("model", IMAGE_MODELS)
def test_data_and_models_build_and_fit_together(data: str, model: str) -> None:
    cfg = composed(f"data={data}", f"model={model}")
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    net = _build_model(cfg, datamodule)
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == (cfg.data.batch_size, *datamodule.input_shape)
    logits = net(x)
    assert logits.shape == (cfg.data.batch_size, datamodule.num_classes)
    assert torch.equal(net.pipeline(x), logits)
    assert net.example_input_array.shape[1:] == x.shape[1:]
    assert net.predict_step((x, y), 0).shape == y.shape
    assert len(net.configure_pipeline()) >= 2


def test_the_gpt_reads_text_and_ties_its_head_to_the_embedding() -> None:
    cfg = composed("data=text", "model=gpt")
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    net = _build_model(cfg, datamodule)
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == y.shape == (cfg.data.batch_size, *datamodule.input_shape)
    logits = net(x)
    assert logits.shape == (*x.shape, datamodule.num_classes)
    assert torch.equal(net.configure_pipeline()(x), logits)
    assert net.head.out.weight is net.embed.wte.weight
    assert len(net.configure_pipeline()) == cfg.model.blocks + 2


def test_the_sequence_model_builds_from_the_sequence_data_and_reads_its_batches() -> None:
    cfg = composed("data=sequences", "model=seq2seq")
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    net = _build_model(cfg, datamodule)
    source, decoder_input, target = next(iter(datamodule.train_dataloader()))
    assert source.shape == decoder_input.shape == target.shape == (cfg.data.batch_size, 8)
    assert torch.equal(decoder_input[:, 1:], target[:, :-1])
    real = source != 0
    assert torch.equal(target[0, : int(real[0].sum())], source[0][real[0]].flip(0))  # reversed
    logits = net((source, decoder_input))
    assert logits.shape == (cfg.data.batch_size, 8, cfg.data.vocab)
    assert torch.equal(net.configure_pipeline()((source, decoder_input)), logits)
    assert len(net.configure_pipeline()) == 5


@pytest.mark.parametrize(
    ("data", "model"),
    [("sequences", "mlp"), ("digits", "seq2seq"), ("digits", "gpt"), ("text", "mlp")],
)
def test_a_model_given_the_wrong_kind_of_data_names_the_fix(data: str, model: str) -> None:
    cfg = composed(f"data={data}", f"model={model}")
    datamodule = instantiate(cfg.data)
    with pytest.raises(ValueError, match=r"model and the data must be of one kind .*pick a data"):
        _build_model(cfg, datamodule)


@pytest.mark.parametrize("sync", options("sync"))
def test_every_sync_mode_builds_the_strategy(sync: str) -> None:
    cfg = composed(f"sync={sync}")
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, PipeDreamStrategy)
    assert (strategy.sync, strategy.microbatches) == (sync, 4)


@pytest.mark.parametrize("cluster", ["cluster_a", "cluster_b", "cluster_c"])
def test_every_cluster_gives_a_topology_the_processes_fit_on(cluster: str) -> None:
    cfg = composed(f"cluster={cluster}")
    topology = instantiate(cfg.cluster.topology)
    assert isinstance(topology, Topology)
    two = topology_for_devices(topology, 2)
    assert two == Topology.flat(2, topology.levels[0].bandwidth)
    assert topology_for_devices(topology, topology.num_workers) == topology


def test_processes_fill_the_cluster_innermost_first() -> None:
    cluster_a = Topology.from_lists([4, 4], [1.2e10, 1.25e9])
    assert topology_for_devices(cluster_a, 1) == Topology.flat(1, 1.2e10)
    assert topology_for_devices(cluster_a, 4) == Topology.flat(4, 1.2e10)
    assert topology_for_devices(cluster_a, 8) == Topology.from_lists([4, 2], [1.2e10, 1.25e9])
    with pytest.raises(TopologyError, match="fill whole machines"):
        topology_for_devices(cluster_a, 6)
    with pytest.raises(TopologyError, match="must fit on the cluster"):
        topology_for_devices(cluster_a, 32)


@pytest.mark.parametrize(("devices", "count"), [(1, 1), (4, 4), ("3", 3), ([0, 2], 2), ((5,), 1)])
def test_processes_are_what_trainer_devices_asks_for(devices: object, count: int) -> None:
    assert num_processes(OmegaConf.create({"devices": devices})) == count


def test_devices_default_to_one_process() -> None:
    assert num_processes(OmegaConf.create({"accelerator": "cpu"})) == 1


@pytest.mark.parametrize(
    ("devices", "shown"), [(0, "0"), (-1, "-1"), ("-1", "-1"), ("auto", "'auto'"), (1.5, "1.5")]
)
def test_devices_that_are_no_process_count_are_refused(devices: object, shown: str) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"(devices: {shown}); for example trainer.devices=2")
    ):
        num_processes(OmegaConf.create({"devices": devices}))


def test_cpu_trainer_builds_with_the_strategy(tmp_path: Path) -> None:
    cfg = composed(output_dir=str(tmp_path))
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy))
    assert isinstance(trainer.strategy, PipeDreamStrategy)
    assert trainer.num_devices == 2
    assert Path(trainer.logger.log_dir) == tmp_path


def test_main_is_a_hydra_app_over_the_package_configs() -> None:
    main = get_method("pl_pipedream.train.main")
    assert callable(main)
    assert (CONFIGS / "train.yaml").is_file()
    assert (REPO / "configs" / "train.yaml").is_file()  # the top-level configs/ link


# ----- end to end (subprocess) ------------------------------------------------------------------


def run_app(*arguments: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "pl_pipedream.train", *arguments],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def final_val_acc(output: str) -> float:
    line = next(line for line in output.splitlines() if "Final metrics:" in line)
    return float(line.split("val_acc=")[1].split(",")[0])


@pytest.mark.slow
def test_main_job_trains_validates_and_writes_its_outputs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_app(
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=16",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert 0.4 < final_val_acc(output) <= 1.0  # chance: 0.1
    for name in ("metrics.csv", "timeline.json", "pipedream_plan.json", ".hydra/config.yaml"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "train_rank1.log").is_file()  # rank 1 wrote into rank 0's folder
    assert "val_acc" in (run_dir / "metrics.csv").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no stray output folders


@pytest.mark.slow
def test_multirun_runs_each_job_with_its_own_ranks(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    done = run_app(
        "--multirun",
        "sync=async,flush",
        "data=synthetic",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=6",
        f"hydra.sweep.dir={sweep_dir}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (done.stdout + done.stderr).count("Final metrics:") == 2
    for job, sync in enumerate(("async", "flush")):
        folder = sweep_dir / str(job)
        plan = (folder / "pipedream_plan.json").read_text()
        assert '"num_workers": 2' in plan
        assert (folder / "train_rank1.log").is_file()
        assert f"sync: {sync}" in (folder / ".hydra" / "config.yaml").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


@pytest.mark.slow
def test_the_sequence_model_trains_across_a_cut_that_carries_several_tensors(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    done = run_app(
        "model=seq2seq",
        "data=sequences",
        "strategy.balance=[2,3]",  # the cut after the encoder carries a dict with a state pair
        "trainer.max_epochs=2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert 0.2 < final_val_acc(done.stdout + done.stderr) <= 1.0  # chance: 1/30
