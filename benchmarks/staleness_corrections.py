"""Delay-aware corrections of ``sync="async"``, measured on the one-process oracle (issue 37).

PLACEHOLDER: the header with the command and the figures is written after the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pl_pipedream.data.digits import DigitsDataModule
from pl_pipedream.models.mlp import MLP
from pl_pipedream.planner.plan import Plan
from tests.runtime import oracle

HIDDEN6 = (128, 128, 128, 128, 64)  # digits6 of docs/convergence.md: 6 Linear, 12 pipeline layers


@dataclass(frozen=True)
class Optim:
    """The optimizer of a setting: ``sgd`` (momentum = beta) or ``adamw`` (betas (beta, 0.999),
    torch's default weight decay 0.01)."""

    kind: str
    lr: float
    beta: float = 0.9
    weight_decay: float = 0.01

    @property
    def label(self) -> str:
        return f"sgd{self.lr:g}-m{self.beta:g}" if self.kind == "sgd" else f"adamw{self.lr:g}"


@dataclass(frozen=True)
class Correction:
    """A set of corrections of the async rule, each off by default.

    predict: (c) stage s runs minibatch i (on version v, d = i - v updates stale) on
        W_v - predict * d * lr * D_v (predict 1: the update's own delay; "pred<k>": k times it), D_v the optimizer's own step direction in its state after update v
        (SGD: the momentum buffer; Adam/AdamW: m_hat / (sqrt(v_hat) + eps) + wd * W_v).
    lr_horizon: (a) PipeMare: update u of stage s steps with lr / tau_s ** (1 - min(u / T, 1)),
        tau_s = max(1, w_s); T in updates (math.inf: lr / tau_s throughout).
    dc: (b) DC-ASGD: the gradient g computed on the stashed W_used is applied as
        g + lambda * g * g * (W_now - W_used); dc is lambda (0: off).
    dc_adaptive: DC-ASGD-a: lambda_t = dc / sqrt(MS_t), MS an elementwise moving mean of g*g
        (rate 0.95): one more buffer per weight.
    momentum: (d) per-stage momentum (SGD) or beta1 (Adam): "pow" beta ** (1 + d_s);
        "implicit" max(0, beta - d_s / (d_s + 1)) (asynchrony adds an implicit momentum of about
        1 - 1 / (d + 1): Mitliagkas et al. 2016); "pow_lr" as "pow" with lr scaled by
        (1 - beta_s) / (1 - beta) so the step lr / (1 - beta) stays (SGD only).
    """

    predict: float = 0.0
    lr_horizon: float = 0.0
    dc: float = 0.0
    dc_adaptive: bool = False
    momentum: str = ""


def stage_beta(beta: float, delay: int, rule: str) -> float:
    if rule in ("pow", "pow_lr"):
        return beta ** (1 + delay)
    if rule == "implicit":
        return max(0.0, beta - delay / (delay + 1))
    return beta


def make_optimizer(opt: Optim, params: list[nn.Parameter], beta: float) -> torch.optim.Optimizer:
    if opt.kind == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=beta)
    return torch.optim.AdamW(params, lr=opt.lr, betas=(beta, 0.999), weight_decay=opt.weight_decay)


@torch.no_grad()
def direction(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> torch.Tensor:
    """The step the optimizer's state points along, lr included (zero before its first step)."""
    group = optimizer.param_groups[0]
    state = optimizer.state.get(param, {})
    if isinstance(optimizer, torch.optim.SGD):
        buf = state.get("momentum_buffer")
        return torch.zeros_like(param) if buf is None else group["lr"] * buf
    if "exp_avg" not in state:
        return torch.zeros_like(param)
    beta1, beta2 = group["betas"]
    step = float(state["step"])
    m_hat = state["exp_avg"] / (1 - beta1**step)
    v_hat = state["exp_avg_sq"] / (1 - beta2**step)
    return group["lr"] * (m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * param)


def train(
    model: nn.Sequential,
    plan: Plan,
    minibatches: list[tuple[torch.Tensor, torch.Tensor]],
    opt: Optim,
    corr: Correction,
    sync: str = "async",
) -> dict[str, torch.Tensor]:
    """``oracle.train``'s per-minibatch rule (straight pipeline, one microbatch per batch) with
    the corrections of ``corr``; ``sync="flush"`` is one device (no correction applies)."""
    assert all(s.replicas == 1 for s in plan.stages)
    model = __import__("copy").deepcopy(model)
    stages = [nn.ModuleDict({n: model[int(n)] for n in st.nodes}) for st in plan.stages]
    delays = [s.warmup if sync == "async" else 0 for s in plan.stages]
    betas = [stage_beta(opt.beta, d, corr.momentum) for d in delays]
    optimizers = [make_optimizer(opt, list(st.parameters()), b) for st, b in zip(stages, betas)]
    base_lr = [
        opt.lr * ((1 - b) / (1 - opt.beta) if corr.momentum == "pow_lr" else 1.0) for b in betas
    ]
    named = [dict(st.named_parameters()) for st in stages]

    def snapshot(s: int) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in named[s].items()}

    def predicted_step(s: int) -> dict[str, torch.Tensor]:
        return {n: direction(optimizers[s], p) for n, p in named[s].items()}

    # version -> weights (and, for predict, the state's step after that version)
    history = [{0: snapshot(s)} for s in range(len(stages))]
    steps = [{0: predicted_step(s)} if corr.predict else {} for s in range(len(stages))]
    mean_square = [{n: None for n in named[s]} for s in range(len(stages))]
    applied = [0] * len(stages)
    for i, (x, y) in enumerate(minibatches):
        used = []
        for s in range(len(stages)):
            v = oracle.version_of(plan, sync, s, i, 1)
            d = i - v
            weights = history[s][v]
            if corr.predict and d > 0 and v > 0:
                ahead = d * corr.predict
                weights = {n: w - ahead * steps[s][v][n] for n, w in weights.items()}
            used.append({n: w.detach().clone().requires_grad_(True) for n, w in weights.items()})
        grads, _ = oracle._gradients(stages, used, {}, x, y, nn.functional.cross_entropy)
        for s, stage_grads in enumerate(grads):
            with torch.no_grad():
                for n, p in named[s].items():
                    g = stage_grads.get(n)
                    if g is not None and corr.dc and delays[s]:
                        lam: Any = corr.dc
                        if corr.dc_adaptive:
                            ms = mean_square[s][n]
                            ms = g * g if ms is None else 0.95 * ms + 0.05 * g * g
                            mean_square[s][n] = ms
                            lam = corr.dc / (ms.sqrt() + 1e-7)
                        g = g + lam * g * g * (p - used[s][n])
                    p.grad = g
            lr = base_lr[s]
            if corr.lr_horizon and delays[s]:
                frac = min(applied[s] / corr.lr_horizon, 1.0) if math.isfinite(corr.lr_horizon) else 0
                lr = lr / max(1, delays[s]) ** (1 - frac)
            optimizers[s].param_groups[0]["lr"] = lr
            optimizers[s].step()
            optimizers[s].zero_grad(set_to_none=True)
            applied[s] += 1
            history[s][applied[s]] = snapshot(s)
            history[s].pop(applied[s] - delays[s] - 2, None)
            if corr.predict:
                steps[s][applied[s]] = predicted_step(s)
                steps[s].pop(applied[s] - delays[s] - 2, None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def evaluate(model: nn.Module, batches: list) -> tuple[float, float]:  # type: ignore[type-arg]
    right = total = 0
    loss = 0.0
    for x, y in batches:
        out = model(x)
        right += int((out.argmax(dim=1) == y).sum())
        loss += float(nn.functional.cross_entropy(out, y, reduction="sum"))
        total += len(y)
    return right / total, loss / total


def setup(seed: int, epochs: int, num_stages: int, hidden=HIDDEN6):  # type: ignore[no-untyped-def]
    data = DigitsDataModule(batch_size=32, seed=seed)
    data.setup("fit")
    batches = [batch for _ in range(epochs) for batch in data.train_dataloader()]
    val = list(data.val_dataloader())
    torch.manual_seed(seed)
    model = MLP((1, 8, 8), 10, hidden=hidden).pipeline
    layers = len(model)
    balance = [layers // num_stages + (k < layers % num_stages) for k in range(num_stages)]
    return batches, val, model, Plan.from_balance(balance)


def parse(name: str, per_epoch: int) -> Correction:
    """A correction from its name: "+"-joined parts of "async" (none), "pred", "lrT<epochs>"
    (PipeMare, horizon in epochs), "lrInf", "dc<lambda>", "dca<lambda0>", "mpow", "mimpl",
    "mpowlr"; e.g. "pred+dca1"."""
    corr = Correction()
    for part in name.split("+"):
        if part == "async":
            continue
        elif part.startswith("pred"):
            corr = replace(corr, predict=float(part[4:] or 1))
        elif part == "lrInf":
            corr = replace(corr, lr_horizon=math.inf)
        elif part.startswith("lrT"):
            corr = replace(corr, lr_horizon=float(part[3:]) * per_epoch)
        elif part.startswith("dca"):
            corr = replace(corr, dc=float(part[3:]), dc_adaptive=True)
        elif part.startswith("dc"):
            corr = replace(corr, dc=float(part[2:]))
        elif part in ("mpow", "mimpl", "mpowlr"):
            corr = replace(corr, momentum={"mpow": "pow", "mimpl": "implicit"}.get(part, "pow_lr"))
        else:
            raise ValueError(f"unknown correction part {part!r} in {name!r}")
    return corr


CORRECTIONS = [
    "async", "pred", "pred1.5", "lrT5", "lrInf", "dca1", "mpow", "mimpl",
    "pred+lrInf", "pred+dca1", "pred+mpow", "pred+mimpl",
]
SETTINGS = {
    "sgd0.03": Optim("sgd", 0.03),
    "sgd0.1": Optim("sgd", 0.1),
    "adamw1e-3": Optim("adamw", 1e-3),
}


def run(setting: str, stages: int, seed: int, names: list[str], epochs: int) -> dict[str, Any]:
    opt = SETTINGS[setting]
    batches, val, model, plan = setup(seed, epochs, stages)
    per_epoch = len(batches) // epochs
    out = {}
    state = train(model, plan, batches, opt, Correction(), sync="flush")
    out["one device"] = _score(state, val)
    for name in names:
        corr = parse(name, per_epoch)
        if corr.momentum == "pow_lr" and opt.kind != "sgd":
            continue
        out[name] = _score(train(model, plan, batches, opt, corr), val)
    return out


def _score(state: dict[str, torch.Tensor], val: list) -> tuple[float, float]:  # type: ignore[type-arg]
    trained = MLP((1, 8, 8), 10, hidden=HIDDEN6).pipeline
    trained.load_state_dict(state)
    return evaluate(trained, val)


def check() -> None:
    """This loop against ``tests/runtime/oracle.py``: no correction vs its async, predict vs its
    weight_prediction (SGD exactly the same rule; AdamW differs by lr * wd * (W_v - W_(v-1)))."""
    batches, _, model, plan = setup(0, 1, 3)
    batches = batches[:20]
    for opt in (Optim("sgd", 0.03), Optim("adamw", 1e-3, weight_decay=0.0), Optim("adamw", 1e-3)):
        def make(params, opt=opt):  # type: ignore[no-untyped-def]
            return make_optimizer(opt, params, opt.beta)

        for sync, corr, wp in (
            ("flush", Correction(), False),
            ("async", Correction(), False),
            ("async", Correction(predict=1.0), True),
        ):
            ref = oracle.train(model, plan, sync, batches, 1, nn.functional.cross_entropy, make, wp)
            ours = train(model, plan, batches, opt, corr, sync=sync)
            diff = max(float((ref[k] - ours[k]).abs().max()) for k in ref)
            wd = f" wd {opt.weight_decay:g}" if opt.kind == "adamw" else ""
            print(f"check {opt.label}{wd} {sync} predict={corr.predict}: max |oracle - this| {diff:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--corrections", nargs="+", default=CORRECTIONS)
    parser.add_argument("--check", action="store_true", help="compare with the oracle and stop")
    parser.add_argument("--json", help="also write every result here")
    args = parser.parse_args()
    if args.check:
        check()
        return
    torch.set_num_threads(1)
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    start = time.time()
    for setting in args.settings:
        for stages in args.stages:
            key = f"{setting}-{stages}st"
            rows: dict[str, list[tuple[float, float]]] = {}
            for seed in range(args.seeds):
                for name, score in run(setting, stages, seed, args.corrections, args.epochs).items():
                    rows.setdefault(name, []).append(score)
            results[key] = rows
            _print(key, rows, time.time() - start)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    _table(results)


def _print(key: str, rows: dict[str, list[tuple[float, float]]], elapsed: float) -> None:
    base = sum(a for a, _ in rows["one device"]) / len(rows["one device"])
    print(f"== {key} ({elapsed:.0f} s)")
    for name, scores in rows.items():
        accs = [a for a, _ in scores]
        mean = sum(accs) / len(accs)
        loss = sum(lo for _, lo in scores) / len(scores)
        mark = "ok" if mean >= base - 0.02 else ""
        shown = " ".join(f"{a:.3f}" for a in accs)
        print(f"  {name:<14} acc {mean:.3f} [{min(accs):.3f}..{max(accs):.3f}] "
              f"({shown}) val_loss {loss:.3f} {mark}", flush=True)


def _table(results: dict[str, dict[str, list[tuple[float, float]]]]) -> None:
    names = list(next(iter(results.values())))
    print("\n| setting | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for key, rows in results.items():
        base = sum(a for a, _ in rows["one device"]) / len(rows["one device"])
        cells = []
        for name in names:
            accs = [a for a, _ in rows.get(name, [])]
            if not accs:
                cells.append("")
                continue
            mean = sum(accs) / len(accs)
            cells.append(f"{mean:.3f}" + ("*" if name != "one device" and mean >= base - 0.02 else ""))
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
