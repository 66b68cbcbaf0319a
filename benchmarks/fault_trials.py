"""Fault trials: SIGKILL a random rank at a random point of training, validation or a checkpoint
save, and count what the surviving ranks do.

Every trial trains the digits MLP (Flatten, Linear 64-64, ReLU, Linear 64-64, ReLU, Linear 64-10;
batch 24, async, one stage and one microbatch per rank) through the real strategy, Lightning's
Trainer and gloo, with validation (2 batches) and ``ModelCheckpoint(every_n_train_steps=5,
save_top_k=1, save_last=True)`` every 5 steps, for at most 30 steps. A seeded RNG picks the
rank to kill and the point:

* ``train``: at the start of a training step (step 6 to 29);
* ``validation``: at the start of a validation batch of the 2nd to 5th validation run;
* ``checkpoint``: inside a save, halfway through writing a file (this rank's shard, or rank 0's
  ``pipeline.json``) of the 5th to 10th file that rank writes (so at least one save is whole).

The chosen rank writes the time and the point to ``killed.json`` and sends itself SIGKILL. The
parent then watches every rank's process id and records, per trial: the seconds from the kill to
the last survivor's exit (a hang is a survivor still there ``--timeout`` + 15 s after the kill;
it is then killed), whether every survivor's output names the dead rank (``rank <r>``; on rank
0 also Lightning's ``[rank: <r>] Child process ... terminated``), whether
any process of the run's process group is left behind, and whether the last complete checkpoint
(``last.ckpt``, consolidated with ``consolidate_checkpoint``) loads and is at least as new as the
last save rank 0 finished. Prints one row per trial and the totals; exits 1 if any trial failed
a check.

    python benchmarks/fault_trials.py                              # 20 trials on 2 and 3 ranks
    python benchmarks/fault_trials.py --quick                      # 3 trials, 2 ranks, one a phase
    python benchmarks/fault_trials.py --trials 5 --ranks 3 --seed 1 --timeout 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import harness

STEPS = 30  # training steps of a trial that is not interrupted
EVERY = 5  # validation and checkpoint interval, in steps
PHASES = ("train", "validation", "checkpoint")
GRACE = 15.0  # seconds past the strategy's timeout before a survivor counts as hung


# ----- the trained script (one per rank, started by the strategy's launcher) --------------------


def run_worker(args: argparse.Namespace) -> None:
    """Train one trial; the rank ``args.victim`` kills itself at ``args.phase`` number
    ``args.at``. Each rank writes its output to ``rank<r>.log`` and its pid to ``pid<r>``."""
    out = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # the launcher sets it for ranks 1..n-1
    log = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    (out / f"pid{rank}").write_text(str(os.getpid()))

    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    from pl_pipedream import PipeDreamStrategy
    from pl_pipedream.core import checkpoint
    from pl_pipedream.data import DigitsDataModule
    from pl_pipedream.models import MLP

    def die(point: str) -> None:
        record = {"rank": rank, "phase": args.phase, "point": point, "time": time.time()}
        (out / "killed.json").write_text(json.dumps(record))
        os.kill(os.getpid(), signal.SIGKILL)

    class Killer(Callback):
        def __init__(self) -> None:
            self.validations = 0

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            if args.phase == "train" and trainer.global_step == args.at:
                die(f"step {args.at}")

        def on_validation_start(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            self.validations += 1

        def on_validation_batch_start(
            self, trainer, module, batch, batch_idx, dataloader_idx=0
        ) -> None:  # type: ignore[no-untyped-def]
            at = (self.validations, batch_idx)
            if args.phase == "validation" and at == (args.at, args.batch):
                die(f"validation {args.at} batch {args.batch}")

    if args.phase == "checkpoint" and rank == args.victim:
        write, files = checkpoint.write_file, []

        def dying_write(path: Path, data: bytes) -> None:
            files.append(path)
            if len(files) == args.at:
                with open(path, "wb") as file:
                    file.write(data[: len(data) // 2])
                die(f"writing {path.name} (file {args.at})")
            write(path, data)

        checkpoint.write_file = dying_write

    if rank == 0:  # record every save rank 0 finished (its step), after it returns
        save = PipeDreamStrategy.save_checkpoint

        def recorded_save(self, ckpt, filepath, storage_options=None):  # type: ignore[no-untyped-def]
            save(self, ckpt, filepath, storage_options)
            with (out / "saved.txt").open("a") as file:
                file.write(f"{Path(filepath).name} {ckpt.get('global_step')}\n")

        PipeDreamStrategy.save_checkpoint = recorded_save  # type: ignore[method-assign]

    killer = Killer() if rank == args.victim else Callback()
    saver = ModelCheckpoint(
        dirpath=out / "ckpts",
        every_n_train_steps=EVERY,
        save_top_k=1,
        monitor="step",
        mode="max",
        save_last=True,
    )
    layers = 6
    ranks = args.ranks[0]
    base, extra = divmod(layers, ranks)
    balance = [base + (1 if s < extra else 0) for s in range(ranks)]
    trainer = Trainer(
        strategy=PipeDreamStrategy(
            sync="async",
            balance=balance,
            microbatches=ranks,
            timeout=args.timeout,
            divergence="off",  # a trial tests a failure's handling; its loss may rise
        ),
        accelerator="cpu",
        devices=ranks,
        max_steps=STEPS,
        val_check_interval=EVERY,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[killer, saver],
    )
    seed_everything(0)  # the same weights and data order in every trial, whatever ran before
    model = MLP((1, 8, 8), 10, hidden=(64, 64), optimizer="sgd", lr=0.05, momentum=0.9)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=24))


# ----- the parent: one trial ---------------------------------------------------------------------


@dataclass
class Trial:
    ranks: int
    victim: int
    phase: str
    at: int
    batch: int = 0
    point: str = ""
    killed: bool = False
    exit_seconds: float | None = None  # kill to the last survivor's exit; None: a hang
    naming: int = 0  # survivors whose output names the dead rank
    left_behind: int = 0  # processes of the run still alive after the trial
    checkpoint: str = ""  # "step N" when last.ckpt loads, else what went wrong
    loads: bool = False

    @property
    def ok(self) -> bool:
        ends = self.exit_seconds is not None
        return self.killed and ends and self.named and self.left_behind == 0 and self.loads

    @property
    def named(self) -> bool:
        """Whether every survivor's output names the dead rank."""
        return self.naming == self.ranks - 1


def pick(rng: random.Random, ranks: int, phase: str | None = None) -> Trial:
    """The rank to kill and the point (and the phase unless given), drawn from ``rng``."""
    victim, phase = rng.randrange(ranks), phase or rng.choice(PHASES)
    if phase == "train":
        return Trial(ranks, victim, phase, rng.randint(EVERY + 1, STEPS - 1))
    if phase == "validation":
        return Trial(ranks, victim, phase, rng.randint(2, STEPS // EVERY - 1), rng.randrange(2))
    # checkpoint: each save writes one shard per rank (and pipeline.json on rank 0), two saves
    # (the top-k file and last.ckpt) every EVERY steps
    per_trigger = 4 if victim == 0 else 2
    return Trial(ranks, victim, phase, rng.randint(per_trigger + 1, 5 * per_trigger // 2 + 1))


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Running processes of the process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def run_trial(trial: Trial, out: Path, timeout: float) -> Trial:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out)]
    command += ["--ranks", str(trial.ranks), "--timeout", str(timeout)]
    command += ["--victim", str(trial.victim), "--phase", trial.phase, "--at", str(trial.at)]
    command += ["--batch", str(trial.batch)]
    env = harness.child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.time()
    launcher = subprocess.Popen(command, env=env, cwd=out, start_new_session=True)
    pids: dict[int, int] = {}
    ended: dict[int, float] = {}
    killed_at: float | None = None
    launcher_ended: float | None = None
    limit = started + 120.0  # a trial whose kill never comes (the run ended first) stops here
    while True:
        if launcher.poll() is not None and launcher_ended is None:
            launcher_ended = time.time()
        for r in range(trial.ranks):
            if r not in pids and (out / f"pid{r}").exists():
                text = (out / f"pid{r}").read_text().strip()
                pids[r] = int(text) if text else 0
        if killed_at is None and (out / "killed.json").exists():
            try:
                killed = json.loads((out / "killed.json").read_text())
                killed_at, trial.point, trial.killed = killed["time"], killed["point"], True
                limit = killed_at + timeout + GRACE
            except (json.JSONDecodeError, KeyError):
                pass
        now = time.time()
        for r, pid in pids.items():
            if r not in ended and pid and not alive(pid):
                ended[r] = now
        if launcher_ended is not None and len(ended) == len(pids):
            if len(pids) == trial.ranks or now > launcher_ended + 3.0:
                break
        if now > limit:
            break
        time.sleep(0.05)
    trial.left_behind = len(group_members(launcher.pid))
    for pid in group_members(launcher.pid):  # our own run's processes, by pid
        os.kill(pid, signal.SIGKILL)
    launcher.wait()
    survivors = [r for r in range(trial.ranks) if r != trial.victim]
    if killed_at is not None and all(r in ended for r in survivors):
        trial.exit_seconds = max(ended[r] for r in survivors) - killed_at
    # "rank 1" in the strategy's errors, "[rank: 1] Child process ... terminated" from Lightning's
    # launcher on rank 0 when a rank it started dies
    pattern = re.compile(rf"\brank:? {trial.victim}\b")
    logs = [(out / f"rank{r}.log") for r in survivors]
    trial.naming = sum(bool(p.exists() and pattern.search(p.read_text())) for p in logs)
    trial.checkpoint, trial.loads = check_checkpoint(out)
    return trial


def check_checkpoint(out: Path) -> tuple[str, bool]:
    """Whether ``last.ckpt`` loads and is at least as new as rank 0's last finished save of it."""
    from pl_pipedream import consolidate_checkpoint

    last = out / "ckpts" / "last.ckpt"
    saved = (out / "saved.txt").read_text().split("\n") if (out / "saved.txt").exists() else []
    steps = [int(s.split()[1]) for s in saved if s.startswith("last.ckpt ")]
    if not last.exists():
        return ("none saved", not steps)
    try:
        consolidate_checkpoint(last)
        step = json.loads((last / "pipeline.json").read_text())["step"]
    except Exception as error:  # noqa: BLE001 - any failure to load is the finding
        return (f"fails: {str(error).splitlines()[0][:60]}", False)
    if steps and step < steps[-1]:
        return (f"step {step} < saved {steps[-1]}", False)
    return (f"step {step}", True)


# ----- the table ----------------------------------------------------------------------------------


def row(i: int, t: Trial) -> str:
    seconds = "HANG" if t.exit_seconds is None else f"{t.exit_seconds:5.1f}"
    if not t.killed:  # the run ended (or failed) before the chosen point came
        seconds, t.point = "-", "not killed: the run ended first"
    return (
        f"{i:3d} | {t.ranks} | {t.victim} | {t.phase:10s} | {t.point[:34]:34s} | {seconds:>5s} | "
        f"{t.naming}/{t.ranks - 1}{'' if t.named else '!'} | {t.left_behind:4d} | {t.checkpoint}"
        f"{'' if t.ok else '  <-- FAILED'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per world size")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0, help="the strategy's timeout (s)")
    parser.add_argument("--quick", action="store_true", help="3 trials on 2 ranks, one per phase")
    parser.add_argument("--out", default="outputs/fault_trials")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--victim", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="train", help=argparse.SUPPRESS)
    parser.add_argument("--at", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.quick:
        args.trials, args.ranks = 3, [2]
    out = Path(args.out).resolve()
    rng = random.Random(args.seed)
    trials: list[Trial] = []
    print(
        "  # | n | killed | point      | where                              | exit  | "
        "named | left | last.ckpt"
    )
    start = time.perf_counter()
    for ranks in args.ranks:
        for i in range(args.trials):
            trial = pick(rng, ranks, PHASES[i % 3] if args.quick else None)
            trials.append(run_trial(trial, out / f"{ranks}ranks-{i:02d}", args.timeout))
            print(row(len(trials), trial), flush=True)
    ok = sum(t.ok for t in trials)
    times = [t.exit_seconds for t in trials if t.exit_seconds is not None]
    print(f"trials: {len(trials)} in {time.perf_counter() - start:.0f} s; passed every check: {ok}")
    print(
        f"hangs: {sum(t.exit_seconds is None for t in trials)}; survivors exit after the kill: "
        + (
            f"median {sorted(times)[len(times) // 2]:.1f} s, max {max(times):.1f} s"
            if times
            else "-"
        )
        + f" (timeout {args.timeout:g} s)"
    )
    print(
        f"dead rank named by every survivor: {sum(t.named for t in trials)}/{len(trials)} trials, "
        f"by {sum(t.naming for t in trials)}/{sum(t.ranks - 1 for t in trials)} survivors; "
        f"processes left behind: {sum(t.left_behind for t in trials)}; "
        f"last.ckpt loads: {sum(t.loads for t in trials)}/{len(trials)}"
    )
    for phase in PHASES:
        some = [t for t in trials if t.phase == phase]
        print(f"  {phase}: {len(some)} trials, {sum(t.ok for t in some)} passed")
    sys.exit(0 if ok == len(trials) else 1)


if __name__ == "__main__":
    main()
