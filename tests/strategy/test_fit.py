"""``Trainer(strategy=PipeDreamStrategy(...))`` end to end, against the oracle of the update rules.

Each case runs ``fit_script.py``: the way a user runs a script (Lightning's script launcher
starts the other ranks), or in this process with the ranks forked from it (``fork``); it trains
every sync mode with SGD (momentum) and Adam, saves a sharded checkpoint on every rank and
consolidates it on rank 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pl_pipedream.planner.plan import Plan
from tests.runtime import oracle
from tests.runtime.test_executor import (
    MODES,
    NUM_BATCHES,
    OPTIMIZERS,
    loss_fn,
    make_batches,
    make_model,
)

SCRIPT = Path(__file__).with_name("fit_script.py")
CASES = {
    "2 stages": ([3, 3], None, 2),
    "3 stages": ([2, 2, 2], None, 3),
    "4 stages": ([1, 2, 2, 1], None, 4),
    "2-1 replicated": ([3, 3], [2, 1], 2),
}


def launch(
    tmp_path: Path, balance, replicas, m, configs, accelerator="cpu", extra=()
) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    """Run ``fit_script.py``; children import this checkout (PYTHONPATH is inherited)."""
    command = [
        sys.executable,
        str(SCRIPT),
        "--balance",
        *map(str, balance),
        "--microbatches",
        str(m),
    ]
    if replicas:
        command += ["--replicas", *map(str, replicas)]
    command += ["--configs", *configs, "--out", str(tmp_path), "--accelerator", accelerator, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )


def fork(tmp_path: Path, balance, replicas, m, configs, extra=()) -> None:  # type: ignore[no-untyped-def]
    """``fit_script``'s fits in this process, the ranks forked from it (no interpreter to start
    per rank); ``launch`` runs the script as a user does."""
    from tests.strategy import fit_script

    argv = ["--balance", *map(str, balance), "--microbatches", str(m), "--out", str(tmp_path)]
    argv += ["--replicas", *map(str, replicas)] if replicas else []
    fit_script.main([*argv, "--configs", *configs, "--start-method", "fork", *extra])


@pytest.fixture(scope="module")
def every_mode(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``label`` -> the folder of one launch of ``fit_script.py`` on ``CASES[label]`` that fits
    every sync mode with every optimizer in turn; launched once, at the first test that asks."""
    folders: dict[str, Path] = {}

    def folder(label: str) -> Path:
        if label not in folders:
            out = tmp_path_factory.mktemp(label.replace(" ", "-"))
            balance, replicas, m = CASES[label]
            configs = [f"{sync}:{name}" for sync in MODES for name in OPTIMIZERS]
            if label == "2 stages":  # as a user runs a script (and the binding test reads it)
                result = launch(out, balance, replicas, m, configs)
                assert result.returncode == 0, result.stderr[-3000:]
            else:
                fork(out, balance, replicas, m, configs)
            folders[label] = out
        return folders[label]

    return folder


@pytest.mark.slow
@pytest.mark.parametrize("label", list(CASES))
def test_fit_then_consolidate_equals_the_oracle(every_mode, label: str) -> None:  # type: ignore[no-untyped-def]
    balance, replicas, m = CASES[label]
    folder = every_mode(label)
    plan = Plan.from_balance(balance, replicas=replicas)
    for sync in MODES:
        for name, make_optimizer in OPTIMIZERS.items():
            out = folder / f"{sync}-{name}"
            assert json.loads((out / "done.json").read_text())["global_step"] == NUM_BATCHES
            got = torch.load(out / "weights.pt")
            expected = oracle.train(
                make_model(), plan, sync, make_batches(m), m, loss_fn, make_optimizer
            )
            assert sorted(got) == sorted(f"net.{k}" for k in expected)
            for key, tensor in expected.items():
                diff = (got[f"net.{key}"] - tensor).abs().max().item()
                assert diff <= 1e-5, f"{label} {sync}/{name} {key}: {diff}"


@pytest.mark.slow
def test_the_chunked_modes_fit_as_one_device(tmp_path: Path) -> None:
    """``sync="interleaved"`` and ``"zbv"``: 4 stages on 2 ranks (``runtime.chunks``) under a
    Lightning Trainer, SGD and Adam stepped by Lightning once per batch, equal one device."""
    configs = ["interleaved:sgd", "zbv:sgd", "zbv:adam"]
    fork(tmp_path, [2, 1, 2, 1], None, 2, configs)
    for config in configs:
        sync, name = config.split(":")
        out = tmp_path / f"{sync}-{name}"
        assert json.loads((out / "done.json").read_text())["global_step"] == NUM_BATCHES
        got = torch.load(out / "weights.pt")
        plan = Plan.from_balance([3, 3])
        expected = oracle.train(
            make_model(), plan, "flush", make_batches(2), 2, loss_fn, OPTIMIZERS[name]
        )
        for key, tensor in expected.items():
            diff = (got[f"net.{key}"] - tensor).abs().max().item()
            assert diff <= 1e-5, f"{sync}/{name} {key}: {diff}"


@pytest.mark.slow
def test_fit_with_both_staleness_corrections_equals_the_oracle(tmp_path: Path) -> None:
    """``weight_prediction=True, lr_warmup_per_delay=2`` through the Trainer (the warm-up's
    wrapper around the stage's updates and Lightning's hooks) on the oracle's rules."""
    configs = ["async:sgd", "vertical_sync:sgd", "async:adam"]
    extra = ["--weight-prediction", "--lr-warmup-per-delay", "2"]
    fork(tmp_path, [3, 3], None, 2, configs, extra=extra)
    plan = Plan.from_balance([3, 3])
    for config in configs:
        sync, name = config.split(":")
        got = torch.load(tmp_path / f"{sync}-{name}" / "weights.pt")
        expected = oracle.train(
            make_model(), plan, sync, make_batches(2), 2, loss_fn, OPTIMIZERS[name], True, 2
        )
        for key, tensor in expected.items():
            diff = (got[f"net.{key}"] - tensor).abs().max().item()
            assert diff <= 1e-5, f"{sync}/{name} {key}: {diff}"


@pytest.mark.slow
def test_strategy_by_name_plans_automatically(tmp_path: Path) -> None:
    """``Trainer(strategy="pipedream")``: defaults (async, one microbatch), planned at setup."""
    command_extra = ["--strategy-name"]
    result = launch(tmp_path, [0], None, 1, ["async:sgd"], extra=command_extra)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PipeDream plan" in result.stderr + result.stdout
    assert (tmp_path / "pipedream_plan.json").is_file()
    out = tmp_path / "async-sgd"
    assert json.loads((out / "done.json").read_text())["global_step"] == NUM_BATCHES
    weights = torch.load(out / "weights.pt")
    assert sorted(weights) == sorted(f"net.{k}" for k in make_model().state_dict())


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process that may run on 2 cores",
)
def test_each_cpu_rank_trains_on_cores_of_its_own_and_gets_all_back(every_mode) -> None:  # type: ignore[no-untyped-def]
    """Read from the oracle test's launch on 2 stages (``[3, 3]``, 2 microbatches), whose fits
    ran in turn in the same processes: every fit binds again."""
    pool = sorted(os.sched_getaffinity(0))
    folder = every_mode("2 stages")
    share = len(pool) // 2
    for sync in ("async", "flush"):
        out = folder / f"{sync}-sgd"
        for rank in range(2):
            record = json.loads((out / f"cpus-rank{rank}.json").read_text())
            assert record["binding"] == pool[rank * share : (rank + 1) * share]
            assert all(cpus == record["binding"] for cpus in record["threads"])
        assert all(
            cpus == pool for cpus in json.loads((out / "done.json").read_text())["threads_after"]
        )


SEQ2SEQ_LAYERS = ("embed", "encoder", "decoder", "attention", "head")  # configure_pipeline order


@pytest.mark.slow
@pytest.mark.parametrize(("world", "balance"), [(2, [1, 4]), (3, [2, 1, 2])])
def test_seq2seq_with_several_tensors_per_boundary_trains_and_validates(
    tmp_path: Path, world: int, balance: list[int]
) -> None:
    """The Seq2Seq example through the Trainer: every mode equals the oracle, ``flush`` equals
    one device (plain Lightning, ``accumulate_grad_batches``), and validation through the
    pipeline gives one device's ``val_loss``."""
    from lightning.pytorch import Trainer

    from tests.runtime import test_boundary
    from tests.runtime.test_boundary import seq2seq_batches, seq2seq_loss, seq2seq_model, sgd
    from tests.strategy.fit_script import seq2seq_loader, seq2seq_net

    m = world  # 2bw needs as many microbatches as stages
    configs = [f"{sync}:sgd" for sync in MODES]
    result = launch(tmp_path, balance, None, m, configs, extra=["--model", "seq2seq"])
    assert result.returncode == 0, result.stderr[-3000:]
    plan = Plan.from_balance(balance)
    got = {sync: torch.load(tmp_path / f"{sync}-sgd" / "weights.pt") for sync in MODES}
    for sync in MODES:
        expected = oracle.train(
            seq2seq_model(), plan, sync, seq2seq_batches(m), m, seq2seq_loss, sgd
        )
        for key, tensor in expected.items():
            index, _, rest = key.partition(".")
            diff = (got[sync][f"{SEQ2SEQ_LAYERS[int(index)]}.{rest}"] - tensor).abs().max().item()
            assert diff <= 1e-5, f"{sync} {key}: {diff}"
    reference = seq2seq_net()
    settings = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
    one = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=m,
        enable_checkpointing=False,
        **settings,
    )
    one.fit(reference, seq2seq_loader(m, 2))  # microbatch-sized batches, accumulated
    for key, tensor in reference.state_dict().items():
        diff = (got["flush"][key] - tensor).abs().max().item()
        assert diff <= 1e-5, f"flush against one device {key}: {diff}"
    val_loss = one.validate(reference, seq2seq_loader(m, 2 * m), verbose=False)[0]["val_loss"]
    done = json.loads((tmp_path / "flush-sgd" / "done.json").read_text())
    assert done["global_step"] == test_boundary.NUM_BATCHES
    assert abs(done["val_loss"] - val_loss) <= 1e-5
