"""The launchers: the popen launcher's exit status and report; every stage's state reaches the
process that spawned the ranks.

Here: the popen launcher run end to end (``failing_script.py``: a rank failing or hanging after
``fit``, a SIGKILL of a middle rank on 4 processes, of a replica on 3), the Lightning internals
the spawn launcher overrides and builds, the launcher chosen by ``start_method``, and the gather
of every rank's stage over gloo. End to end, every fork test (the same launcher)
in ``test_lightning_features.py`` compares the launching process's model with the oracle, which
only this launcher's gather fills (Lightning loads the returned weights with ``strict=False``,
so a stage missing from them would otherwise go unnoticed).
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.strategy.launcher import (
    PipelineScriptLauncher,
    PipelineSpawnLauncher,
    _gather_state_dict,
)
from pl_pipedream.strategy.lightning_patches import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    WorkerOutput,
)
from tests.runtime.distributed import run

SCRIPT = Path(__file__).with_name("failing_script.py")
KILL_2_AT_2 = ("--fail", "kill", "--rank", "2", "--at", "2")
# The strategy's timeout bounds the ranks' rendezvous too: 20 s (the script's) failed the start
# of 2 and 4 ranks on 2 loaded cores. A longer one costs these runs nothing (their ranks end by
# themselves); the hang's run waits it out (plus 10 s), and starts alone.
SLOW_START = ("--timeout", "60")
RUNS = {  # failing_script.py's arguments per run
    "after-fit": ("--fail", "after-fit", *SLOW_START),
    "hang": ("--fail", "hang-after-fit", "--timeout", "10"),
    "killed middle": (*KILL_2_AT_2, "--devices", "4", *SLOW_START),
    "killed replica": (*KILL_2_AT_2, "--devices", "3", *SLOW_START),
}
HANG = "hang"


class Runs:
    """``failing_script.py`` run as a user runs it, once per ``RUNS`` entry, each alone: these
    checks hold deadlines of seconds (a rank failing 2 s after rank 0 ended, a peer's death
    noticed), which runs sharing 2 cores with another run's training missed."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self.results: dict[str, subprocess.CompletedProcess[str]] = {}

    def start(self, name: str) -> None:
        if name in self.procs:
            return
        folder = self.factory.mktemp(name.replace(" ", "-"))
        with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), *RUNS[name]],
                cwd=folder,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=out,
                stderr=err,
                start_new_session=True,  # one process group: ``close`` ends every rank
            )
        self.procs[name] = (proc, folder)

    def text(self, name: str) -> str:
        return (self.procs[name][1] / "stderr").read_text(errors="replace")[-3000:]

    def result(self, name: str) -> subprocess.CompletedProcess[str]:
        """The run ``name`` to its end (started now if it was not)."""
        if name not in self.results:
            self.start(name)
            proc, folder = self.procs[name]
            proc.wait(timeout=240)
            read = [(folder / f).read_text(errors="replace") for f in ("stdout", "stderr")]
            self.results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, *read)
        return self.results[name]

    def close(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    started = Runs(tmp_path_factory)
    try:
        yield started
    finally:
        started.close()


def report_of(stderr: str) -> list[str]:
    """The report: the command's last lines, from the first ``pl-pipedream: rank`` line on."""
    return stderr[stderr.index("pl-pipedream: rank") :].splitlines()


# ----- popen: who watches the ranks --------------------------------------------------------------


def test_popen_starts_the_ranks_and_watches_them_without_lightnings_observer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lightning's ``child-process-observer`` thread SIGKILLs every rank within 5 s of one
    failing, before any report: the popen launcher starts the ranks and its own watcher only."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from pl_pipedream.strategy import launcher as launcher_module

    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # setenv first: monkeypatch then restores the variable's absence after the test, undoing
        # what launch() writes; a bare delenv of an absent variable records nothing, and the
        # rank variables leaked into every later test's subprocesses
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(launcher_module, "script_command", lambda: [sys.executable, "-c", "0"])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # launch() installs its own
    environment = LightningEnvironment()
    assert not environment.creates_processes_externally
    launcher = PipelineScriptLauncher(environment, num_processes=3, num_nodes=1, timeout=30)
    assert launcher.launch(lambda: "fitted") == "fitted"
    names = [thread.name for thread in threading.enumerate()]
    assert "child-process-observer" not in names and "pl-pipedream-rank-watcher" in names
    assert launcher.ranks is not None and len(launcher.procs) == 2
    assert launcher.ranks.finish() == ("", 0)  # both ranks exited 0
    assert [proc.returncode for proc in launcher.procs] == [0, 0]


# ----- popen: how the command ends ----------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_failing_after_rank_0_finished_fails_the_command(runs: Runs) -> None:
    """Rank 1 raises after ``fit``, when rank 0 has returned: the command exits 1 and its last
    lines are rank 1's error, printed once."""
    result = runs.result("after-fit")
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    tail = result.stderr.rstrip().splitlines()
    start = max(i for i, line in enumerate(tail) if line.startswith("pl-pipedream: rank"))
    assert tail[start] == "pl-pipedream: rank 1 failed (exit code: 1); its error:", tail[start:]
    assert tail[-1].strip() == "RuntimeError: the user's code failed on rank 1 after fit"
    assert result.stderr.count("pl-pipedream: rank 1 failed") == 1


@pytest.mark.slow
def test_a_killed_middle_rank_is_named_first_and_the_command_exits_1(runs: Runs) -> None:
    """Rank 2 of 4 is SIGKILLed in step 2: its neighbours fail with a PeerError naming it, and
    the report leads with rank 2 itself; the command exits 1, not Lightning's 137 (its observer
    SIGKILLed every rank within 5 s, leaving no report)."""
    result = runs.result("killed middle")
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "Forcefully terminating" not in result.stderr
    report = report_of(result.stderr)
    assert report[0] == "pl-pipedream: rank 2 failed (killed by SIGKILL); its error:", report
    assert len([line for line in report if line.startswith("pl-pipedream: rank")]) == 4


@pytest.mark.slow
def test_a_killed_replica_is_named_first_and_by_its_replica(runs: Runs) -> None:
    """Rank 2, the second replica of stage 1, is SIGKILLed in step 2: its replica (rank 1)
    fails inside the replica all-reduce with a PeerError naming rank 2 and its stage (gloo's
    text named an address and port), and the report leads with rank 2."""
    result = runs.result("killed replica")
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    report = report_of(result.stderr)
    assert report[0] == "pl-pipedream: rank 2 failed (killed by SIGKILL); its error:", report
    assert "pl-pipedream: rank 1 failed as well (PeerError; exit code: 1)" in report, report
    assert "rank 1 (stage 1) could not sum the gradients of update " in result.stderr
    assert "with its replica rank 2 (stage 1): the connection was closed by rank 2 (stage 1)" in (
        result.stderr
    )


@pytest.mark.slow
def test_a_rank_that_hangs_after_fit_fails_the_command_and_is_named(runs: Runs) -> None:
    """Rank 1 never ends after ``fit``: rank 0 waits its timeout plus a margin, stops it, and
    the command exits 1 naming it (it exited 0 and named nothing). Last: the other runs went
    on while it waited."""
    result = runs.result(HANG)
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert report_of(result.stderr)[0] == (
        "pl-pipedream: rank 1 was stopped at the deadline, still running 20 s after rank 0 "
        "ended (killed by SIGTERM)"
    )


def test_lightning_collects_each_workers_results_through_the_overridden_method() -> None:
    assert hasattr(MultiProcessingLauncher, "_collect_rank_zero_results")
    source = inspect.getsource(MultiProcessingLauncher._wrapping_function)
    assert "self._collect_rank_zero_results(trainer, results)" in source


def test_the_launching_process_loads_the_weights_file_a_worker_names() -> None:
    source = inspect.getsource(MultiProcessingLauncher._recover_results_in_main_process)
    assert "worker_output.weights_path" in source and "load_state_dict(" in source


def test_worker_output_takes_its_fields_in_the_order_the_launcher_passes_them() -> None:
    assert WorkerOutput._fields == (
        "best_model_path",
        "weights_path",
        "trainer_state",
        "trainer_results",
        "extra",
    )


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_spawn_and_fork_launch_with_the_pipeline_launcher(start_method: str) -> None:
    strategy = PipeDreamStrategy(balance=[1, 1], start_method=start_method)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert isinstance(trainer.strategy.launcher, PipelineSpawnLauncher)
    assert trainer.strategy.launcher._start_method == start_method


def test_popen_launches_like_ddp() -> None:
    strategy = PipeDreamStrategy(balance=[1, 1], start_method="popen")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert isinstance(trainer.strategy.launcher, SubprocessScriptLauncher)
    assert type(trainer.strategy.launcher) is PipelineScriptLauncher  # watches the ranks itself


def _gather(rank: int, world: int) -> dict[str, torch.Tensor]:
    """What the launcher gathers: every rank's stage state under the module's names."""
    own = {f"net.{rank}.weight": torch.full((2,), float(rank)), "scale": torch.ones(1) * rank}
    return _gather_state_dict(world, own)


@pytest.mark.slow  # two processes that import Lightning: about 5 s
def test_every_rank_contributes_its_stage_merged_under_the_modules_names() -> None:
    results = run(2, _gather, timeout=60.0)
    for rank, (status, state) in results.items():
        assert status == "ok", f"rank {rank}: {state}"
        assert sorted(state) == ["net.0.weight", "net.1.weight", "scale"]
        assert torch.equal(state["net.1.weight"], torch.ones(2))
        assert torch.equal(state["scale"], torch.zeros(1))  # rank 0's state outside the pipeline


def test_a_hydra_scripts_child_command_is_lightnings(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from hydra import compose, initialize
    from hydra.core.hydra_config import HydraConfig
    from lightning.fabric.strategies.launchers.subprocess_script import _hydra_subprocess_cmd

    from pl_pipedream.strategy.launcher import hydra_child_command

    assert hydra_child_command(1) is None  # Hydra is not running
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "train.py"), "trainer.devices=2"])
    with initialize(version_base=None, config_path=None):
        config = compose(return_hydra_config=True, overrides=["hydra.run.dir=out/run"])
        config.hydra.runtime.cwd = str(tmp_path)
        HydraConfig.instance().set_config(config)
        try:
            command, cwd = _hydra_subprocess_cmd(1)
            assert hydra_child_command(1) == (list(command), cwd)
        finally:
            HydraConfig.instance().cfg = None
