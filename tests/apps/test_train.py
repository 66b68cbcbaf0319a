"""The Hydra app ``pl-pipedream-train``: every config composes, the pieces build, runs work.

How rank 0 starts the other ranks is tested in test_hydra_ranks.py.

Composition and construction run in-process (no training). The slow tests check what the app
prints and writes: one real launch as a user types it (``run_app``: a ``--multirun`` of the main
job, whose rank 0 starts rank 1 by re-running the app), the others with the app's ``main`` on
ranks forked from this process as a launcher that sets ``LOCAL_RANK`` starts them (``fork_app``).
"""

from __future__ import annotations

import csv
import inspect
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import get_class, get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from pl_pipedream import PipeDreamStrategy, Topology
from pl_pipedream.apps.train import (
    MachineError,
    _build_model,
    apply_smoke,
    check_machine,
    num_processes,
    topology_for_devices,
)
from pl_pipedream.planner.topology import TopologyError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "pl_pipedream" / "configs"
GROUPS = ("data", "model", "cluster", "sync", "trainer")


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIGS / group).glob("*.yaml"))


def composed(*overrides: str, output_dir: str = "/tmp/pl-pipedream-test") -> DictConfig:
    with initialize_config_module("pl_pipedream.configs", version_base="1.3"):
        return compose("train", overrides=[f"output_dir={output_dir}", *overrides])


PAPER_MODELS = ["alexnet", "awd_lm", "gnmt16", "gnmt8", "resnet50", "s2vt", "vgg16"]


def test_every_group_has_its_options() -> None:
    assert options("model") == sorted(["cnn", "gpt", "mlp", "seq2seq", *PAPER_MODELS])
    assert options("data") == [
        "digits",
        "imagenet",
        "msvd",
        "ptb",
        "sequences",
        "synthetic",
        "text",
        "wmt16",
    ]
    assert options("cluster") == ["cluster_a", "cluster_b", "cluster_c", "local"]
    assert options("sync") == [
        "2bw",
        "async",
        "flush",
        "gpipe",
        "interleaved",
        "vertical_sync",
        "zbv",
        "zero_bubble",
    ]
    assert options("trainer") == ["cpu", "gpu"]


def test_every_option_composes_and_resolves_beside_the_groups_it_meets() -> None:
    """Every option of every group composes and resolves alone, and changes only its own node
    (``sync``: the strategy's ``sync`` and ``microbatches``): no option reaches into another
    group's, so the pairs of groups that meet compose as their parts do, and are checked on
    those parts. Data meets sync (the batch splits into microbatches) in every pair; model meets
    data when built (test_data_and_models_build_and_fit_together and the tests after it)."""
    nodes = {"data": {"data"}, "model": {"model"}, "cluster": {"cluster"}, "trainer": {"trainer"}}
    nodes["sync"] = {"strategy"}
    with initialize_config_module("pl_pipedream.configs", version_base="1.3"):
        default = resolved_config()
        alone = {
            group: {o: resolved_config(f"{group}={o}") for o in options(group)} for group in GROUPS
        }
    for group, configs in alone.items():
        for option, cfg in configs.items():
            changed = {key for key in {*cfg, *default} if cfg.get(key) != default.get(key)}
            assert changed <= nodes[group], (group, option, changed)
            for node in ("data", "model", "strategy", "trainer"):
                get_class(cfg[node]["_target_"])
            assert cfg["strategy"]["timeline"] == "/tmp/x/timeline.json"
            assert (cfg["smoke"], cfg["smoke_settings"]) == (False, {})
            if group == "sync":
                assert cfg["strategy"]["sync"] == option
                assert set(cfg["strategy"]) - set(default["strategy"]) <= {"microbatches"}
    for data, sync in itertools.product(alone["data"].values(), alone["sync"].values()):
        assert data["data"]["batch_size"] % sync["strategy"]["microbatches"] == 0
    assert alone["data"]["digits"] == default and alone["sync"]["async"] == default


def resolved_config(*overrides: str) -> dict:
    """``train`` composed with ``overrides`` (under an initialised config module), resolved."""
    cfg = compose("train", overrides=["output_dir=/tmp/x", *overrides])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    return resolved


def test_defaults_are_the_main_job() -> None:
    cfg = composed()
    assert cfg.data._target_.endswith("DigitsDataModule")
    assert cfg.model._target_.endswith("MLP")
    assert cfg.cluster.topology is None
    assert (cfg.strategy.sync, cfg.strategy.balance) == ("async", None)
    assert (cfg.trainer.accelerator, num_processes(cfg.trainer)) == ("cpu", 2)
    assert cfg.trainer.use_distributed_sampler is False
    assert cfg.trainer.logger.save_dir == "/tmp/pl-pipedream-test"


NOT_IMAGES = ("msvd", "ptb", "sequences", "text", "wmt16")
IMAGE_DATA = [name for name in options("data") if name not in NOT_IMAGES]
IMAGE_MODELS = [name for name in options("model") if name not in ("seq2seq", "gpt", *PAPER_MODELS)]


@pytest.mark.parametrize("data", IMAGE_DATA)
@pytest.mark.parametrize("model", IMAGE_MODELS)
def test_data_and_models_build_and_fit_together(data: str, model: str) -> None:
    """Built from the shipped configs, on batches of 8 (the shapes are what meet; a batch of 64
    224 x 224 images through the digits CNN took seconds)."""
    cfg = composed(f"data={data}", f"model={model}", "data.batch_size=8")
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


# ----- the paper's models -----------------------------------------------------------------------

# model config: (data config, overrides that shrink the model and the data for a quick build)
PAPER_BUILDS = {
    "vgg16": ("synthetic", ["model.width=16", "data.input_shape=[3,32,32]"]),
    "alexnet": ("synthetic", ["model.width=16", "data.input_shape=[3,64,64]"]),
    "resnet50": ("synthetic", ["model.width=16", "data.input_shape=[3,32,32]"]),
    "gnmt8": ("sequences", ["model.scale=64"]),
    "gnmt16": ("sequences", ["model.scale=64"]),
    "awd_lm": ("text", ["model.scale=50"]),
}
# the class's pipeline layers at these settings, counted from the papers' architectures
PAPER_LAYERS = {"vgg16": 40, "alexnet": 22, "resnet50": 18, "gnmt8": 11, "gnmt16": 19, "awd_lm": 5}


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_paper_model_configs_are_the_full_models_with_arguments_their_class_takes(
    model: str,
) -> None:
    cfg = composed(f"model={model}")
    cls = get_class(cfg.model._target_)
    arguments: set[str] = set()
    for klass in cls.__mro__:  # GNMT8 passes **kwargs on to GNMT
        parameters = inspect.signature(klass.__init__).parameters
        arguments |= set(parameters)
        if all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            break
    given = {key: value for key, value in cfg.model.items() if key != "_target_"}
    assert set(given) <= arguments, set(given) - arguments
    size = "width" if "width" in given else "scale"
    assert given[size] == 1  # the published model
    text = (CONFIGS / "model" / f"{model}.yaml").read_text()
    assert text.startswith("# ") and '"' in text.splitlines()[0] + text.splitlines()[1]  # paper


@pytest.mark.parametrize("model", list(PAPER_BUILDS))
def test_paper_model_builds_small_from_its_config_and_data_and_scores_a_batch(model: str) -> None:
    data, shrink = PAPER_BUILDS[model]
    cfg = composed(f"model={model}", f"data={data}", *shrink, "data.batch_size=16")
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    net = _build_model(cfg, datamodule).eval()
    batch = next(iter(datamodule.train_dataloader()))
    inputs = (batch[0], batch[1]) if len(batch) == 3 else batch[0]
    logits = net(inputs)
    classes = datamodule.num_classes
    expected = (len(batch[0]), classes) if data == "synthetic" else (*batch[-1].shape, classes)
    assert logits.shape == expected
    assert torch.equal(net.configure_pipeline()(inputs), logits)
    assert len(net.configure_pipeline()) == PAPER_LAYERS[model]


def test_s2vt_needs_video_data_and_says_so() -> None:
    cfg = composed("model=s2vt", "data=sequences")
    with pytest.raises(ValueError, match=r"S2VT takes video, data: .* gives sequences\); pick"):
        _build_model(cfg, instantiate(cfg.data))


# ----- smoke runs, the machine, the results file --------------------------------------------------


def test_smoke_settings_are_merged_only_with_smoke_true() -> None:
    settings = [
        "++smoke_settings.model.width=16",
        "++smoke_settings.data.input_shape=[3,32,32]",
        "++smoke_settings.trainer.max_steps=4",
        "++smoke_settings.cluster.topology=null",
        "++smoke_settings.strategy.timeline=${output_dir}/smoke.json",
    ]
    full = composed("model=vgg16", "data=synthetic", "cluster=cluster_a", *settings)
    assert apply_smoke(full) is full
    assert (full.model.width, full.trainer.max_steps, list(full.data.input_shape)) == (
        1,
        -1,
        [1, 8, 8],
    )
    assert full.cluster.topology.workers == [4, 4]
    smoke = apply_smoke(
        composed("model=vgg16", "data=synthetic", "cluster=cluster_a", "smoke=true", *settings)
    )
    assert (smoke.model.width, smoke.trainer.max_steps) == (16, 4)
    assert list(smoke.data.input_shape) == [3, 32, 32]  # a list is replaced, not merged
    assert smoke.cluster.topology is None
    assert smoke.strategy.timeline == "/tmp/pl-pipedream-test/smoke.json"
    assert (smoke.model.lr, smoke.trainer.devices) == (0.01, 2)  # the rest stays


def test_smoke_true_without_settings_changes_nothing() -> None:
    cfg = composed("smoke=true")
    before = OmegaConf.to_container(cfg)
    assert OmegaConf.to_container(apply_smoke(cfg)) == before


@pytest.mark.parametrize(
    ("overrides", "cuda", "environ", "message"),
    [
        (
            ["trainer=gpu", "cluster=cluster_a", "trainer.num_nodes=4", "trainer.devices=4"],
            0,
            {"NODE_RANK": "0"},
            "this run needs 16 GPUs on 4 nodes (trainer.accelerator: gpu, trainer.num_nodes: 4, "
            "trainer.devices: 4) and this machine has no CUDA device; run it on the cluster "
            "(docs/reproducing.md: Recipes) or add smoke=true",
        ),
        (
            ["trainer=gpu", "trainer.devices=4"],
            2,
            {},
            "this run needs 4 GPUs on 1 node (trainer.accelerator: gpu, trainer.num_nodes: 1, "
            "trainer.devices: 4) and this machine has 2 CUDA devices; run it on the cluster",
        ),
        (
            ["trainer.num_nodes=2"],
            0,
            {},
            "this run needs 4 processes on 2 nodes (trainer.accelerator: cpu, trainer.num_nodes: "
            "2, trainer.devices: 2) and no launcher set this node's rank (NODE_RANK, GROUP_RANK "
            "or SLURM_NODEID); run it on the cluster",
        ),
        (
            ["cluster=cluster_a", "trainer.devices=8"],
            0,
            {},
            "this run needs 8 processes on 1 node (trainer.accelerator: cpu, trainer.num_nodes: "
            "1, trainer.devices: 8) and the cluster's innermost level holds 4 workers, the "
            "cluster 16 in all; run it on the cluster",
        ),
        (
            ["cluster=cluster_c", "trainer.num_nodes=4", "trainer.devices=2"],
            0,
            {"SLURM_NODEID": "3"},
            "this run needs 8 processes on 4 nodes (trainer.accelerator: cpu, trainer.num_nodes: "
            "4, trainer.devices: 2) and the cluster's innermost level holds 4 workers, the "
            "cluster 4 in all",
        ),
        (
            ["cluster=cluster_a", "trainer.num_nodes=2"],  # planned for 2 of 4 processes
            0,
            {"NODE_RANK": "0"},
            "the topology planned for must have one worker per process (topology workers: 2, "
            "trainer.accelerator: cpu, trainer.num_nodes: 2, trainer.devices: 2); give the "
            "layout by hand (strategy.balance=[...])",
        ),
        (
            ["trainer=gpu", "smoke=true"],
            0,
            {},
            "and this machine has no CUDA device; smoke_settings must bring the run to this "
            "machine (trainer.accelerator: cpu, trainer.devices: 2, trainer.num_nodes: 1)",
        ),
    ],
)
def test_a_run_this_machine_cannot_hold_is_refused_naming_what_it_needs(
    overrides: list[str], cuda: int, environ: dict[str, str], message: str
) -> None:
    with pytest.raises(MachineError, match=re.escape(message)):
        check_machine(composed(*overrides), cuda_devices=cuda, environ=environ)


@pytest.mark.parametrize(
    ("overrides", "cuda", "environ"),
    [
        ([], 0, {}),  # the main job
        (["cluster=cluster_a"], 0, {}),  # 2 processes: 2 GPUs of one server
        (["cluster=cluster_c"], 0, {}),
        (["trainer=gpu", "cluster=cluster_a", "trainer.devices=4"], 4, {}),
        (["trainer=gpu", "trainer.num_nodes=4", "trainer.devices=4"], 4, {"GROUP_RANK": "1"}),
    ],
)
def test_a_run_this_machine_can_hold_passes(
    overrides: list[str], cuda: int, environ: dict[str, str]
) -> None:
    check_machine(composed(*overrides), cuda_devices=cuda, environ=environ)


@pytest.mark.parametrize("sync", options("sync"))
def test_every_sync_mode_builds_the_strategy(sync: str) -> None:
    cfg = composed(f"sync={sync}")
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, PipeDreamStrategy)
    assert (strategy.sync, strategy.microbatches) == (sync, 4)


def test_chunks_per_rank_reaches_the_strategy_and_defaults_to_the_modes() -> None:
    assert instantiate(composed().strategy).chunks_per_rank is None
    cfg = composed("strategy.sync=interleaved", "strategy.chunks_per_rank=3")
    strategy = instantiate(cfg.strategy)
    assert (strategy.sync, strategy.chunks_per_rank) == ("interleaved", 3)


def test_the_replan_options_reach_the_strategy_and_default_to_off() -> None:
    assert instantiate(composed().strategy).replanning.mode == "off"
    cfg = composed(
        "strategy.replan=auto", "strategy.replan_every=5", "strategy.replan_threshold=0.1"
    )
    replanning = instantiate(cfg.strategy).replanning
    assert (replanning.mode, replanning.every, replanning.threshold) == ("auto", 5, 0.1)
    assert instantiate(composed("strategy.replan=off").strategy).replanning.mode == "off"


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


@pytest.mark.parametrize("trainer", ["cpu", "gpu"])
def test_precision_is_a_trainer_key_that_defaults_to_lightnings(trainer: str) -> None:
    assert composed(f"trainer={trainer}").trainer.precision is None  # Trainer(precision=None)
    assert composed(f"trainer={trainer}", "trainer.precision=bf16-mixed").trainer.precision == (
        "bf16-mixed"
    )


@pytest.mark.parametrize(("given", "precision"), [((), "32-true"), (("bf16-mixed",), "bf16-mixed")])
def test_the_trainer_takes_the_precision_given_without_plus(
    tmp_path: Path, given: tuple[str, ...], precision: str
) -> None:
    overrides = [f"trainer.precision={value}" for value in given]
    cfg = composed(*overrides, output_dir=str(tmp_path))
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy))
    assert trainer.precision == precision
    assert isinstance(trainer.strategy, PipeDreamStrategy)


def test_main_is_a_hydra_app_over_the_package_configs() -> None:
    main = get_method("pl_pipedream.apps.train.main")
    assert callable(main)
    assert (CONFIGS / "train.yaml").is_file()
    assert (REPO / "configs" / "train.yaml").is_file()  # the top-level configs/ link


# ----- end to end -----------------------------------------------------------------------------


def run_app(*arguments: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "pl_pipedream.apps.train", *arguments],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def app_rank(rank: int, argv: list[list[str]], cwd: Path) -> None:
    """Rank ``rank`` of the app: its ``main`` with the command line ``argv[rank]``."""
    from pl_pipedream.apps.train import main

    os.chdir(cwd)
    sys.argv = ["pl-pipedream-train", *argv[rank]]
    main()


def fork_app(
    *arguments: str, cwd: Path, ranks: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``run_app``'s RUN-mode job with its ranks forked from this process (no interpreter to
    start per rank), as a launcher that sets ``LOCAL_RANK`` starts them: rank 0 runs
    ``arguments``, every other rank the command line the app's own launcher gives it
    (``hydra_ranks.child_command``: this job's overrides, rank 0's ``hydra.run.dir``). The
    status is rank 0's when every rank ended alike, else 1 (as the app's launcher reports a
    failed rank); stdout is rank 0's, stderr rank 0's then the other ranks'. With ``ranks=1``
    no rank variable is set: the command as typed by hand (the app would start its own ranks)."""
    from pl_pipedream.hydra_ranks import child_command
    from tests.runtime.launched import launch

    flags = [a for a in arguments if a.startswith("--")]
    overrides = [a for a in arguments if not a.startswith("--")]
    hydra = [o for o in overrides if o.startswith("hydra.")]
    run_dir = next(o.split("=", 1)[1] for o in hydra if o.startswith("hydra.run.dir="))
    name = next((f.split("=", 1)[1] for f in flags if f.startswith("--config-name=")), None)
    dirs = [f.split("=", 1)[1] for f in flags if f.startswith("--config-dir=")]
    task = [o for o in overrides if o not in hydra]
    child = child_command(task, hydra, run_dir, name, dirs)[3:]
    argv = [list(arguments)] + [[*child, f"hydra.job.name=train_rank{r}"] for r in range(1, ranks)]
    with tempfile.TemporaryDirectory() as outputs:  # outside cwd: the app's folders only there
        ends = launch(
            ranks,
            app_rank,
            argv,
            cwd,
            folder=Path(outputs),
            timeout=timeout,
            launcher_env=ranks > 1,
        )
    codes = {end.code for end in ends}
    code = ends[0].code if len(codes) == 1 else 1
    stderr = "".join(end.stderr for end in ends) + "".join(end.stdout for end in ends[1:])
    return subprocess.CompletedProcess(argv[0], code, ends[0].stdout, stderr)


def final_val_acc(output: str) -> float:
    line = next(line for line in output.splitlines() if "Final metrics:" in line)
    return float(line.split("val_acc=")[1].split(",")[0])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The one real launch of the app here, as a user types it: ``--multirun`` over two sync
    modes of the main job (the default config, ``async`` first), each job starting its rank 1
    by the app's own launcher; the folder it ran in and everything it printed."""
    cwd = tmp_path_factory.mktemp("sweep-cwd")
    done = run_app(
        "--multirun",
        "sync=async,flush",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=16",
        f"hydra.sweep.dir={cwd / 'sweep'}",
        cwd=cwd,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return cwd, done.stdout + done.stderr


@pytest.mark.slow
def test_main_job_trains_validates_and_writes_its_outputs(sweep: tuple[Path, str]) -> None:
    cwd, output = sweep
    run_dir = cwd / "sweep" / "0"  # the main job: the default config
    assert 0.4 < final_val_acc(output) <= 1.0  # chance: 0.1
    for name in ("metrics.csv", "timeline.json", "pipedream_plan.json", ".hydra/config.yaml"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "train_rank1.log").is_file()  # rank 1 wrote into rank 0's folder
    assert "val_acc" in (run_dir / "metrics.csv").read_text()
    results = json.loads((run_dir / "results.json").read_text())
    assert results["metrics"]["val_acc"] == pytest.approx(final_val_acc(output), abs=5e-5)
    assert results["plan"]["stages"] == 2


@pytest.mark.slow
def test_multirun_runs_each_job_with_its_own_ranks(sweep: tuple[Path, str]) -> None:
    cwd, output = sweep
    assert output.count("Final metrics:") == 2
    for job, sync in enumerate(("async", "flush")):
        folder = cwd / "sweep" / str(job)
        plan = (folder / "pipedream_plan.json").read_text()
        assert '"num_workers": 2' in plan
        assert (folder / "train_rank1.log").is_file()
        assert f"sync: {sync}" in (folder / ".hydra" / "config.yaml").read_text()
    assert sorted(p.name for p in cwd.iterdir()) == ["sweep"]  # no stray output folders


@pytest.mark.slow
def test_the_sequence_model_trains_across_a_cut_that_carries_several_tensors(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    done = fork_app(
        "model=seq2seq",
        "data=sequences",
        "strategy.balance=[2,3]",  # the cut after the encoder carries a dict with a state pair
        "trainer.max_epochs=2",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert 0.2 < final_val_acc(done.stdout + done.stderr) <= 1.0  # chance: 1/30


@pytest.mark.slow
def test_the_app_trains_in_the_precision_given_without_plus(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    given = ["trainer.precision=bf16-mixed", "trainer.max_epochs=1", f"hydra.run.dir={run_dir}"]
    done = fork_app(*given, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Using bfloat16 Automatic Mixed Precision" in done.stdout + done.stderr
    assert 0.4 < final_val_acc(done.stdout + done.stderr) <= 1.0  # chance: 0.1
    results = json.loads((run_dir / "results.json").read_text())
    assert results["config"]["trainer"]["precision"] == "bf16-mixed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_gpu_run_stops_before_any_rank_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = fork_app("trainer=gpu", f"hydra.run.dir={run_dir}", cwd=tmp_path, ranks=1, timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert (
        "pl-pipedream-train: this run needs 2 GPUs on 1 node (trainer.accelerator: gpu, "
        "trainer.num_nodes: 1, trainer.devices: 2) and this machine has no CUDA device"
    ) in done.stderr
    assert not (run_dir / "train_rank1.log").exists()  # no other rank started
    assert not (run_dir / "results.json").exists()


def test_ckpt_path_is_a_config_key_that_is_null_by_default(tmp_path: Path) -> None:
    from pl_pipedream.apps.train import checkpoint_to_resume

    assert composed().ckpt_path is None
    assert checkpoint_to_resume(composed(output_dir=str(tmp_path))) is None
    given = composed("ckpt_path='/x/epoch=1.ckpt'", output_dir=str(tmp_path))  # '=': quoted
    assert checkpoint_to_resume(given) == "/x/epoch=1.ckpt"  # as trainer.fit takes it


def test_ckpt_path_last_takes_the_newest_checkpoint_of_the_output_dir(tmp_path: Path) -> None:
    from pl_pipedream.apps.train import checkpoint_to_resume

    cfg = composed("ckpt_path=last", output_dir=str(tmp_path))
    assert checkpoint_to_resume(cfg) is None  # a requeued job's first run starts afresh
    folder = tmp_path / "checkpoints"
    sharded = folder / "last.ckpt"  # a sharded checkpoint: a directory with its description
    sharded.mkdir(parents=True)
    (sharded / "pipeline.json").write_text("{}")
    os.utime(sharded / "pipeline.json", (1000, 1000))
    plain = folder / "epoch=0-step=19.ckpt"
    plain.write_text("")
    os.utime(plain, (500, 500))
    (folder / ".pipedream-old-x.ckpt").mkdir()  # no description: no checkpoint
    assert checkpoint_to_resume(cfg) == str(sharded)
    os.utime(plain, (2000, 2000))
    assert checkpoint_to_resume(cfg) == str(plain)


def metrics_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.slow
def test_a_preempted_and_resumed_app_run_keeps_every_step_of_its_metrics_once(
    tmp_path: Path,
) -> None:
    """SIGTERM at step 25 of 38, then the same command with ckpt_path=last: metrics.csv holds
    every training step once, in order, from 0 to the last, each epoch's validation, and the
    rows the preempted run wrote as it wrote them."""
    common = ["sync=flush", "model.hidden=[16]", "trainer.max_epochs=2", "strategy.balance=[2,2]"]
    common += ["trainer.log_every_n_steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
    metrics = tmp_path / "run" / "metrics.csv"
    signal = "+trainer.callbacks=[{_target_:tests.app_signal.SigtermAt,step:25}]"
    stopped = fork_app(*common, signal, cwd=tmp_path)
    assert stopped.returncode == 143, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    before = metrics_rows(metrics)
    assert [int(row["step"]) for row in before if row["train_loss"]][:26] == list(range(26))
    resumed = fork_app(*common, "ckpt_path=last", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = metrics_rows(metrics)
    assert [int(row["step"]) for row in after if row["train_loss"]] == list(range(38))
    # each epoch's validation at its last step, then the app's final validation
    validated = [(row["epoch"], row["step"]) for row in after if row["val_acc"]]
    assert validated == [("0", "18"), ("1", "37"), ("2", "38")]
    assert after[: len(before)] == before


@pytest.mark.slow
def test_a_preempted_app_run_resumes_with_ckpt_path_last_where_it_would_have_ended(
    tmp_path: Path,
) -> None:
    """SIGTERM at step 25 of 38 (the app's preemption saves last.ckpt and exits 143); the same
    command with ckpt_path=last and the same hydra.run.dir ends with the uninterrupted run's
    step and weights, bit for bit (flush: the preemption's drain changes nothing), on a 2-stage
    pipeline; the same checkpoint continued on another cluster (3 processes, another balance and
    sync mode) ends with the same weights to float rounding."""
    from pl_pipedream import consolidate_checkpoint

    # a given plan: an automatic one comes from profiles measured at setup, and the two runs
    # could choose two plans (data parallel or a pipeline) whose sums differ in the last bits
    common = ["sync=flush", "model.hidden=[16]", "trainer.max_epochs=2", "strategy.balance=[2,2]"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = fork_app(*common, f"hydra.run.dir={whole}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    signal = "+trainer.callbacks=[{_target_:tests.app_signal.SigtermAt,step:25}]"
    stopped = fork_app(*common, f"hydra.run.dir={cut}", signal, cwd=tmp_path)
    assert stopped.returncode == 143, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "in the app with pl-pipedream-train" in stopped.stdout
    assert "ckpt_path=last" in stopped.stdout
    assert not (cut / "checkpoints" / "epoch=1-step=38.ckpt").exists()
    kept = tmp_path / "preempted.ckpt"  # the same checkpoint, resumed below on another cluster
    shutil.copytree(cut / "checkpoints" / "last.ckpt", kept)
    resumed = fork_app(*common, f"hydra.run.dir={cut}", "ckpt_path=last", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming from {cut / 'checkpoints' / 'last.ckpt'}" in resumed.stdout + resumed.stderr
    final = "checkpoints/epoch=1-step=38.ckpt"  # the same last step
    want, got = consolidate_checkpoint(whole / final), consolidate_checkpoint(cut / final)
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    assert final_val_acc(resumed.stdout + resumed.stderr) == final_val_acc(
        done.stdout + done.stderr
    )
    # on 3 processes with another balance and sync mode (gpipe trains as flush does), from the
    # preemption's checkpoint: the same weights to float rounding (other sums per stage)
    elsewhere = tmp_path / "elsewhere"
    moved = ["sync=gpipe", "model.hidden=[16]", "trainer.max_epochs=2", "trainer.devices=3"]
    moved += ["strategy.balance=[1,2,1]", f"hydra.run.dir={elsewhere}", f"ckpt_path={kept}"]
    continued = fork_app(*moved, cwd=tmp_path, ranks=3)
    assert continued.returncode == 0, continued.stdout[-3000:] + continued.stderr[-3000:]
    there = consolidate_checkpoint(elsewhere / final)
    for key in want:
        torch.testing.assert_close(there[key], want[key], rtol=0, atol=1e-6)
