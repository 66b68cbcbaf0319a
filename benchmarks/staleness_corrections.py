"""Delay-aware corrections of ``sync="async"``, measured on the one-process oracle.

An exploration, not a decision: which correction of PipeDream's weight stashing makes ``async``
learn what one device learns. ``train`` below is ``tests/runtime/oracle.py``'s async rule
(straight pipeline, stage s w_s = p - 1 - s updates stale, one update per 32-example minibatch,
weights applied in index order; it reuses the oracle's ``version_of`` and ``_gradients``) with
the corrections of ``Correction`` added; ``sync="flush"`` with one microbatch is one device.
``--check`` compares it with the oracle itself.

Model and data: digits6 of docs/convergence.md (flatten, Linear 64-128, 128-128, 128-128,
128-128, 128-64, 64-10 with ReLUs: 12 pipeline layers cut evenly into 2, 3 or 4 stages; into 8
as [2, 2, 2, 2, 1, 1, 1, 1], where stages 4 and 6 hold a ReLU alone and no parameters but still
count for every other stage's delay),
scikit-learn digits through ``DigitsDataModule(batch_size=32, seed)`` (its seeded split and
per-epoch shuffle), 15 epochs = 585 updates per stage, seeds 0..2 (split, order and initial
weights). Optimizers: SGD lr 0.03 and 0.1 momentum 0.9, AdamW lr 1e-3 (betas 0.9/0.999, wd 0.01).
Equal samples and equal updates coincide here: one microbatch per batch, so async and one device
both step every stage once per 32 examples (the Nesterov paper's trap, 4x fewer sync updates,
does not arise). The score is the final validation accuracy (270 examples; 1/270 = 0.004).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/staleness_corrections.py --check   # 17 s
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/staleness_corrections.py           # 630 s
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/staleness_corrections.py --settings sgd0.03 \
        --stages 3 4 --epochs 40 --corrections async pred pred1.5 pred+dca1 pred+lrInf

Correction names ("+" joins them; ``parse``): ``pred`` prediction along the optimizer's own step
(SGD: W - d lr buf, which is the runtime's ``weight_prediction`` exactly; AdamW: W - d lr (m_hat
/ (sqrt(v_hat) + eps) + wd W), the runtime's rule up to lr wd (W_v - W_(v-1))); ``pred1.5`` the
same 1.5 d steps ahead; ``lrT5`` PipeMare lr / tau_s^(1 - min(u / T, 1)), tau_s = max(1, w_s),
u the updates before, T = 5 epochs (``lrU200``: T = 200 updates); ``lrInf`` lr / tau_s
throughout: the runtime's learning rate per delay (``runtime.staleness.DelayScaledUpdate``)
with ``delay_lr_updates`` T and 0; ``dca1`` DC-ASGD-a (g + lambda_t g g (W_now -
W_stashed), lambda_t = 1 / sqrt(moving mean of g g)); ``mpow`` stage momentum/beta1 beta^(1 +
w_s); ``mimpl`` beta - w_s / (w_s + 1) (asynchrony's implicit momentum taken off).

Printed on 2 shared CPU cores (torch 2.13.0+cpu), --check (20 updates; lrU8 anneals over 8):

    check 3st sgd0.03-m0.9 flush async: max |oracle - this| 0.00e+00
    check 3st sgd0.03-m0.9 async async: max |oracle - this| 0.00e+00
    check 3st sgd0.03-m0.9 async pred: max |oracle - this| 7.45e-09
    check 3st sgd0.03-m0.9 async lrInf: max |oracle - this| 0.00e+00
    check 3st sgd0.03-m0.9 async pred+lrU8: max |oracle - this| 7.45e-09
    check 3st adamw0.001 wd 0 flush async: max |oracle - this| 0.00e+00
    check 3st adamw0.001 wd 0 async async: max |oracle - this| 0.00e+00
    check 3st adamw0.001 wd 0 async pred: max |oracle - this| 2.79e-07
    check 3st adamw0.001 wd 0 async lrInf: max |oracle - this| 0.00e+00
    check 3st adamw0.001 wd 0 async pred+lrU8: max |oracle - this| 2.05e-07
    check 3st adamw0.001 wd 0.01 flush async: max |oracle - this| 0.00e+00
    check 3st adamw0.001 wd 0.01 async async: max |oracle - this| 0.00e+00
    check 3st adamw0.001 wd 0.01 async pred: max |oracle - this| 2.23e-03
    check 3st adamw0.001 wd 0.01 async lrInf: max |oracle - this| 0.00e+00
    check 3st adamw0.001 wd 0.01 async pred+lrU8: max |oracle - this| 9.42e-07
    check 8st sgd0.03-m0.9 flush async: max |oracle - this| 0.00e+00
    check 8st sgd0.03-m0.9 async async: max |oracle - this| 0.00e+00
    check 8st sgd0.03-m0.9 async pred: max |oracle - this| 1.70e-05
    check 8st sgd0.03-m0.9 async lrInf: max |oracle - this| 0.00e+00
    check 8st sgd0.03-m0.9 async pred+lrU8: max |oracle - this| 7.45e-09
    check 8st adamw0.001 wd 0 flush async: max |oracle - this| 0.00e+00
    check 8st adamw0.001 wd 0 async async: max |oracle - this| 0.00e+00
    check 8st adamw0.001 wd 0 async pred: max |oracle - this| 1.42e-07
    check 8st adamw0.001 wd 0 async lrInf: max |oracle - this| 0.00e+00
    check 8st adamw0.001 wd 0 async pred+lrU8: max |oracle - this| 2.03e-07
    check 8st adamw0.001 wd 0.01 flush async: max |oracle - this| 0.00e+00
    check 8st adamw0.001 wd 0.01 async async: max |oracle - this| 0.00e+00
    check 8st adamw0.001 wd 0.01 async pred: max |oracle - this| 4.81e-06
    check 8st adamw0.001 wd 0.01 async lrInf: max |oracle - this| 0.00e+00
    check 8st adamw0.001 wd 0.01 async pred+lrU8: max |oracle - this| 3.40e-06

(AdamW with weight decay: the 2e-3 is Adam normalising the lr wd (W_v - W_(v-1)) difference of
1.7e-8 per prediction over 20 steps; without decay the two rules agree to 3e-7. SGD pred at 8
stages: 1.7e-5 is float32 rounding that 8-stage staleness at full rate amplifies; the same
check in float64 gives 2.8e-17.)

The grid (the second command; its table, means only, in two halves: mean final val_acc over
seeds 0..2; * within 0.02 of one device; 630 s):

    setting       one device      async       pred    pred1.5       lrT5      lrInf       dca1
    sgd0.03-2st        0.932      0.833      0.852     0.912*      0.833      0.833      0.844
    sgd0.03-3st        0.932      0.449      0.749      0.864      0.499      0.542      0.637
    sgd0.03-4st        0.932      0.307      0.516      0.520      0.257      0.326      0.258
    sgd0.1-2st         0.440      0.140      0.153      0.200      0.140      0.140      0.295
    sgd0.1-3st         0.440      0.084      0.084      0.119      0.084      0.084      0.073
    sgd0.1-4st         0.440      0.084      0.084      0.084      0.125      0.130      0.084
    adamw1e-3-2st      0.948     0.954*     0.957*     0.954*     0.954*     0.954*     0.956*
    adamw1e-3-3st      0.948      0.923     0.943*     0.951*      0.926      0.916     0.942*
    adamw1e-3-4st      0.948     0.942*     0.951*     0.942*     0.956*     0.937*     0.948*

    setting             mpow      mimpl pred+lrInf  pred+dca1  pred+mpow pred+mimpl
    sgd0.03-2st        0.706      0.751      0.852      0.896     0.933*      0.791
    sgd0.03-3st        0.381      0.430      0.812      0.706      0.670      0.520
    sgd0.03-4st        0.415      0.360      0.531      0.667      0.323      0.365
    sgd0.1-2st         0.168      0.365      0.153      0.247      0.384      0.259
    sgd0.1-3st         0.144      0.233      0.170      0.084      0.084      0.332
    sgd0.1-4st         0.084      0.209      0.084      0.084      0.084      0.199
    adamw1e-3-2st     0.940*     0.949*     0.957*     0.953*     0.954*     0.946*
    adamw1e-3-3st     0.952*     0.956*     0.956*     0.954*     0.933*     0.957*
    adamw1e-3-4st     0.956*     0.935*     0.949*     0.947*     0.951*      0.910

The 40-epoch run (third command; 1,560 updates per stage; 162 s), as printed:

    setting       one device      async       pred    pred1.5  pred+dca1 pred+lrInf
    sgd0.03-3st        0.973      0.940     0.965*     0.956*     0.973*     0.983*
    sgd0.03-4st        0.973      0.832      0.878      0.836      0.948     0.967*

Reading it: AdamW is within 0.02 of one device at 2 and 4 stages without correction, and every
prediction variant (pred, pred1.5, pred+dca1, pred+lrInf) is at 2-4 stages. SGD lr 0.03
momentum 0.9 is the hard case: after 15 epochs nothing is within 0.02 at 3-4 stages (pred1.5
and pred+mpow are at 2). One device itself sits on a loss plateau (2.30) for 3-4 epochs here and
async leaves it later, so 15 epochs mostly measures that escape; at 40 epochs pred+lrInf
(prediction and lr / tau_s) is within 0.02 at 3 and 4 stages, pred+dca1 at 3 (0.948 at 4),
plain async is not (0.940, 0.832). SGD lr 0.1: one device learns on 2 seeds of 3 (0.104 0.493
0.722) and no async variant does reliably: not a setting one device learns.

Per seed, spread and val_loss: the script prints them per setting (e.g. sgd0.03-3st one device
0.933 0.919 0.944, async 0.463 0.422 0.463, pred 0.807 0.837 0.604, pred1.5 0.844 0.889 0.859).
Earlier sweeps on sgd0.03-3st (3 seeds, same command with --corrections): DC-ASGD with a constant
lambda 0.1 / 1 / 10 / 100: 0.488 / 0.485 / 0.541 / 0.578; DC-ASGD-a lambda0 0.1 / 1 / 4: 0.468 /
0.637 / 0.412; PipeMare T = 1 / 5 / 15 epochs / inf: 0.298 / 0.499 / 0.344 / 0.542; momentum
"pow" with lr scaled to keep lr / (1 - beta) (mpowlr): 0.420; pred2 / pred3: 0.678 / 0.627.

The learning rate per delay (``delay_lr_updates``) at 2, 4 and 8 stages, 5 seeds, 40 epochs
(1,560 updates per stage; lrT5 is T = 195 updates, lrT20 T = 780), one command per optimizer,
run one after the other (457 s and 763 s):

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/staleness_corrections.py --settings sgd0.03 \
        --stages 2 4 8 --seeds 5 --epochs 40 \
        --corrections async pred pred+lrInf pred+lrT5 pred+lrT20 lrInf
    (the same with --settings adamw1e-3)

One device has converged by 40 epochs: over seeds 0..4 (``--stages 2 --seeds 5 --corrections
async`` at 20, 40 and 60 epochs) it reaches 0.955 / 0.974 / 0.971 with SGD and 0.950 / 0.973 /
0.974 with AdamW. The two tables as printed, in two halves (mean ± sd of the final val_acc over
seeds 0..4; * within 0.02 of one device):

    setting           one device         async          pred    pred+lrInf
    sgd0.03-2st      0.974±0.017  0.968±0.019*  0.976±0.012*  0.976±0.012*
    sgd0.03-4st      0.974±0.017   0.651±0.260   0.817±0.128  0.957±0.018*
    sgd0.03-8st      0.974±0.017   0.081±0.017   0.164±0.135   0.673±0.162
    adamw1e-3-2st    0.973±0.018  0.970±0.008*  0.973±0.012*  0.973±0.012*
    adamw1e-3-4st    0.973±0.018  0.968±0.014*  0.967±0.011*  0.967±0.015*
    adamw1e-3-8st    0.973±0.018  0.960±0.011*  0.967±0.015*  0.957±0.016*

    setting            pred+lrT5    pred+lrT20         lrInf
    sgd0.03-2st     0.976±0.012*  0.976±0.012*  0.968±0.019*
    sgd0.03-4st      0.950±0.035   0.933±0.011   0.859±0.172
    sgd0.03-8st      0.081±0.017   0.142±0.080   0.364±0.128
    adamw1e-3-2st   0.973±0.012*  0.973±0.012*  0.970±0.008*
    adamw1e-3-4st   0.972±0.009*  0.969±0.013*  0.970±0.010*
    adamw1e-3-8st   0.964±0.014*   0.888±0.174   0.950±0.018

Per seed (the lines it prints): sgd0.03-4st async 0.922 0.737 0.837 0.437 0.322, pred 0.959
0.956 0.719 0.722 0.730, pred+lrInf 0.970 0.948 0.981 0.944 0.941; sgd0.03-8st pred+lrInf 0.830
0.826 0.441 0.633 0.637; adamw1e-3-8st pred+lrT20 0.578 0.970 0.970 0.952 0.970. Since the 8-stage
SGD runs had not finished learning, the same at 80 epochs (``--stages 8 --epochs 80
--corrections async pred pred+lrInf lrInf``, 236 s):

    | setting | one device | async | pred | pred+lrInf | lrInf |
    | sgd0.03-8st | 0.970±0.015 | 0.081±0.017 | 0.141±0.131 | 0.881±0.164 | 0.657±0.260 |

(pred+lrInf per seed 0.948 0.948 0.589 0.944 0.974.)

Reading it. Equal samples and equal updates are the same point here (one update per stage per 32
examples in every column). At 2 stages tau_s = max(1, 1) = 1 everywhere, so every lr column equals
its column without (pred+lr* = pred, lrInf = async). SGD lr 0.03 momentum 0.9: the learning rate
per delay with prediction is the only correction within 0.02 of one device at 4 stages (0.957, sd
0.018, against async 0.651 sd 0.260 and pred 0.817), and the best by far at 8 (0.673 at 40 epochs,
0.881 at 80, against async at chance, 0.081); annealing it back to the base rate (lrT5, lrT20)
gives back most of the gain at 8 stages, and without prediction (lrInf) it closes a third to two
thirds of the gap to one device. AdamW lr 1e-3: every column is within 0.02 at 2 and 4 stages and
the differences are within one sd; at 8 stages async 0.960, pred 0.967, pred+lrInf 0.957, lrInf
0.950, pred+lrT20 one seed collapsed (0.578): AdamW, which normalises its steps, does not need the
learning rate per delay, and dividing it only slows learning a little.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
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
        W_v - predict * d * lr * D_v ("pred": predict 1; "pred<k>": k), D_v the optimizer's own
        step direction in its state after update v
        (SGD: the momentum buffer; Adam/AdamW: m_hat / (sqrt(v_hat) + eps) + wd * W_v).
    lr_horizon: (a) PipeMare: update u of stage s steps with lr / tau_s ** (1 - min(u / T, 1)),
        tau_s = max(1, w_s) (tau_plus_one: w_s + 1); T in updates (math.inf: lr / tau_s
        throughout).
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
    tau_plus_one: bool = False
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
    model = copy.deepcopy(model)
    stages = [nn.ModuleDict({n: model[int(n)] for n in st.nodes}) for st in plan.stages]
    delays = [s.warmup if sync == "async" else 0 for s in plan.stages]
    betas = [stage_beta(opt.beta, d, corr.momentum) for d in delays]
    optimizers = [  # None: a stage without parameters (a ReLU alone, with 8 stages)
        make_optimizer(opt, params, b) if (params := list(st.parameters())) else None
        for st, b in zip(stages, betas, strict=True)
    ]
    base_lr = [
        opt.lr * ((1 - b) / (1 - opt.beta) if corr.momentum == "pow_lr" else 1.0) for b in betas
    ]
    named = [dict(st.named_parameters()) for st in stages]

    def snapshot(s: int) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in named[s].items()}

    def predicted_step(s: int) -> dict[str, torch.Tensor]:
        optimizer = optimizers[s]
        if optimizer is None:
            return {}
        return {n: direction(optimizer, p) for n, p in named[s].items()}

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
                frac = (
                    min(applied[s] / corr.lr_horizon, 1.0) if math.isfinite(corr.lr_horizon) else 0
                )
                tau = delays[s] + 1 if corr.tau_plus_one else max(1, delays[s])
                lr = lr / tau ** (1 - frac)
            optimizer = optimizers[s]
            if optimizer is not None:
                optimizer.param_groups[0]["lr"] = lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
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
    """A correction from its name: "+"-joined parts of "async" (none), "pred", "pred<k>",
    "lrT<epochs>" (PipeMare, horizon in epochs), "lrInf", either with "p1" (tau = d + 1),
    "lrU<updates>" (horizon in updates),
    "dc<lambda>", "dca<lambda0>", "mpow", "mimpl", "mpowlr"; e.g. "pred+dca1"."""
    corr = Correction()
    for part in name.split("+"):
        if part == "async":
            continue
        elif part.startswith("pred"):
            corr = replace(corr, predict=float(part[4:] or 1))
        elif part.startswith("lrU"):  # lrU<updates>
            corr = replace(corr, lr_horizon=float(part[3:]))
        elif part.startswith("lr"):  # lrT<epochs> or lrInf, "p1" at the end: tau = d + 1
            plus = part.endswith("p1")
            horizon = part[2:].removesuffix("p1")
            epochs = math.inf if horizon == "Inf" else float(horizon.removeprefix("T"))
            corr = replace(corr, lr_horizon=epochs * per_epoch, tau_plus_one=plus)
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
    "async",
    "pred",
    "pred1.5",
    "lrT5",
    "lrInf",
    "dca1",
    "mpow",
    "mimpl",
    "pred+lrInf",
    "pred+dca1",
    "pred+mpow",
    "pred+mimpl",
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


CHECKS = (  # sync, correction, oracle.train's (weight_prediction, _, delay_lr_updates)
    ("flush", "async", (False, 0, None)),
    ("async", "async", (False, 0, None)),
    ("async", "pred", (True, 0, None)),
    ("async", "lrInf", (False, 0, 0)),
    ("async", "pred+lrU8", (True, 0, 8)),
)


def check() -> None:
    """This loop against ``tests/runtime/oracle.py``: no correction vs its async, predict vs its
    weight_prediction (SGD exactly the same rule; AdamW differs by lr * wd * (W_v - W_(v-1))),
    lrInf and lrU<T> vs its delay_lr_updates 0 and T, at 3 stages and at 8 (two of them without
    parameters)."""
    for stages in (3, 8):
        batches, _, model, plan = setup(0, 1, stages)
        batches = batches[:20]
        for opt in (
            Optim("sgd", 0.03),
            Optim("adamw", 1e-3, weight_decay=0.0),
            Optim("adamw", 1e-3),
        ):

            def make(params, opt=opt):  # type: ignore[no-untyped-def]
                return make_optimizer(opt, params, opt.beta)

            for sync, name, flags in CHECKS:
                ref = oracle.train(
                    model, plan, sync, batches, 1, nn.functional.cross_entropy, make, *flags
                )
                ours = train(model, plan, batches, opt, parse(name, len(batches)), sync=sync)
                diff = max(float((ref[k] - ours[k]).abs().max()) for k in ref)
                wd = f" wd {opt.weight_decay:g}" if opt.kind == "adamw" else ""
                print(
                    f"check {stages}st {opt.label}{wd} {sync} {name}: max |oracle - this| "
                    f"{diff:.2e}",
                    flush=True,
                )


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
                for name, score in run(
                    setting, stages, seed, args.corrections, args.epochs
                ).items():
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
        print(
            f"  {name:<14} acc {mean:.3f} [{min(accs):.3f}..{max(accs):.3f}] "
            f"({shown}) val_loss {loss:.3f} {mark}",
            flush=True,
        )


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
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            mark = "*" if name != "one device" and mean >= base - 0.02 else ""
            cells.append(f"{mean:.3f}±{sd:.3f}{mark}")
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
