"""A single-process oracle of the update rules in docs/guide.md, independent of the schedule module.

It trains a model on one process, minibatch by minibatch in index order, choosing for every
stage the weight version the rule names and applying each stage's updates when their
minibatches are complete. Every runtime test compares the pipeline's weights with this.

Rules (stage s, replicas r_s, warm-up w_s, Lightning batch t of m microbatches, i = t*m + j):

* async: minibatch i uses version max(0, i // r_s - w_s); update u of stage s averages the
  gradients of minibatches (u-1)*r_s .. u*r_s - 1;
* vertical_sync: c = r_0 * max(0, i // r_0 - w_0); stage s uses version c // r_s; updates as async;
* 2bw: batch t uses version max(0, t - 1); one update per batch, mean over its microbatches;
* flush, gpipe: batch t uses version t; one update per batch, mean over its microbatches.

Tied parameters (one parameter object used by layers of several stages) have a history of their
own: minibatch i uses version max(0, i - (p-1)) in the per-minibatch modes (one update per
minibatch), the mode's batch version otherwise (one update per batch, mean over its
microbatches); every update applies the gradient summed over all uses, from an optimizer of its
own (the optimizers here keep per-parameter state, so this equals one optimizer over both).

Corrections of stale weights (per-minibatch modes only; stage s, minibatch i on version v):

* weight prediction: d = i // r_s - v (updates of stage s a synchronous run would have applied
  before minibatch i, less v); for d > 0 and v > 0 the minibatch's forward and backward run on
  W_v + d * (W_v - W_(v-1)), taken from the stage's history of versions;
* learning-rate warm-up per delay: the stage's delay d_s is w_s in async and
  ceil(r_0 * w_0 / r_s) in vertical_sync; its u-th update (u = 1, 2, ...) steps with the
  learning rate times min(1, u / (factor * d_s)) (no warm-up where that product is 0);
* learning rate per delay (T: ``delay_lr_updates``): with tau_s = max(1, d_s) and n the updates
  stage s has applied before, its next update steps with the learning rate over
  tau_s ** (1 - n / T) while n < T and with the learning rate itself from then on; T = 0 keeps
  it over tau_s for good. With the warm-up as well, both factors multiply.

Every layer is called as ``nn.Sequential`` calls it: with one argument, the microbatch's inputs
(a tensor, or any tuple, list or dict of them) for the first, the previous layer's output
(whatever it is) for the others. Inputs and targets are split into microbatches along dim 0,
tensor by tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from pl_pipedream.planner.plan import Plan

PER_MINIBATCH = ("async", "vertical_sync")


def version_of(plan: Plan, sync: str, stage: int, i: int, m: int) -> int:
    s = plan.stages[stage]
    first = plan.stages[0]
    t = i // m
    if sync == "async":
        return max(0, i // s.replicas - s.warmup)
    if sync == "vertical_sync":
        covered = first.replicas * max(0, i // first.replicas - first.warmup)
        return covered // s.replicas
    if sync == "2bw":
        return max(0, t - 1)
    return t


def tie_version(plan: Plan, sync: str, i: int, m: int) -> int:
    if sync in PER_MINIBATCH:
        return max(0, i - (plan.num_stages - 1))
    return max(0, i // m - 1) if sync == "2bw" else i // m


def train(
    model: nn.Sequential,
    plan: Plan,
    sync: str,
    batches: Sequence[tuple[Any, Any]],
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    weight_prediction: bool = False,
    lr_warmup_per_delay: int = 0,
    delay_lr_updates: int | None = None,
) -> dict[str, torch.Tensor]:
    """Train a copy of ``model`` (layers named "0", "1", ...) and return its final state dict."""
    corrected = weight_prediction or lr_warmup_per_delay or delay_lr_updates is not None
    assert not corrected or sync in PER_MINIBATCH, "the corrections are per-minibatch rules"
    model = copy.deepcopy(model)
    stages = [nn.ModuleDict({n: model[int(n)] for n in stage.nodes}) for stage in plan.stages]
    ties = _ties(stages)  # param id -> the tied parameter
    assert not (corrected and ties), "the corrections do not cover tied parameters"
    optimizers = [make_optimizer(own) if (own := _own(stage, ties)) else None for stage in stages]
    tie_optimizers = {key: make_optimizer([param]) for key, param in ties.items()}
    tie_history = {
        key: [param.detach().clone().requires_grad_(True)] for key, param in ties.items()
    }
    tie_pending: dict[int, torch.Tensor] = {}
    tie_count = 0
    history = [[_clone(stage, ties)] for stage in stages]
    pending: list[dict[str, torch.Tensor]] = [{} for _ in stages]
    counts = [0 for _ in stages]
    applied = [0 for _ in stages]  # updates per stage, for the warm-up
    ramps = [lr_warmup_per_delay * _stage_delay(plan, sync, s) for s in range(len(stages))]
    taus = [max(1, _stage_delay(plan, sync, s)) for s in range(len(stages))]
    m = num_microbatches
    for t, (x, y) in enumerate(batches):
        xs, ys = chunk(x, m), chunk(y, m)
        for j in range(m):
            i = t * m + j
            params = []
            for s in range(len(stages)):
                v = version_of(plan, sync, s, i, m)
                d = i // plan.stages[s].replicas - v
                if weight_prediction and v > 0 and d > 0:
                    params.append(_extrapolate(history[s][v], history[s][v - 1], d))
                else:
                    params.append(history[s][v])
            tied = {key: h[tie_version(plan, sync, i, m)] for key, h in tie_history.items()}
            grads, tie_grads = _gradients(stages, params, tied, xs[j], ys[j], loss_fn)
            for s, stage_grads in enumerate(grads):
                for name, grad in stage_grads.items():
                    pending[s][name] = pending[s].get(name, 0) + grad
                counts[s] += 1
                size = plan.stages[s].replicas if sync in PER_MINIBATCH else m
                if counts[s] == size:
                    scale = _delay_scale(taus[s], applied[s], delay_lr_updates)
                    applied[s] += 1
                    scale *= 1.0 if ramps[s] == 0 else min(1.0, applied[s] / ramps[s])
                    _apply(stages[s], optimizers[s], pending[s], size, ties, scale)
                    history[s].append(_clone(stages[s], ties))
                    pending[s], counts[s] = {}, 0
            for key, grad in tie_grads.items():
                tie_pending[key] = tie_pending.get(key, 0) + grad
            tie_count += 1
            size = 1 if sync in PER_MINIBATCH else m
            if ties and tie_count == size:
                for key, param in ties.items():
                    param.grad = tie_pending[key] / size if key in tie_pending else None
                    tie_optimizers[key].step()
                    tie_optimizers[key].zero_grad(set_to_none=True)
                    tie_history[key].append(param.detach().clone().requires_grad_(True))
                tie_pending, tie_count = {}, 0
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ties(stages: list[nn.ModuleDict]) -> dict[int, nn.Parameter]:
    """The parameters that more than one stage uses, by id."""
    users: dict[int, set[int]] = {}
    objects = {}
    for s, stage in enumerate(stages):
        for param in stage.parameters():
            users.setdefault(id(param), set()).add(s)
            objects[id(param)] = param
    return {key: objects[key] for key, used in users.items() if len(used) > 1}


def chunk(value: Any, m: int) -> list[Any]:
    """``value`` (a tensor, or tuples, lists and dicts of tensors) split along dim 0 into ``m``
    equal parts; anything else is repeated."""
    if isinstance(value, torch.Tensor):
        return list(value.chunk(m))
    if isinstance(value, (tuple, list)):
        parts = [chunk(item, m) for item in value]
        return [type(value)(p[j] for p in parts) for j in range(m)]
    if isinstance(value, dict):
        split = {key: chunk(item, m) for key, item in value.items()}
        return [{key: item[j] for key, item in split.items()} for j in range(m)]
    return [value] * m


def _own(stage: nn.ModuleDict, ties: dict[int, nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in stage.parameters() if id(p) not in ties]


def _clone(stage: nn.ModuleDict, ties: dict[int, nn.Parameter]) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone().requires_grad_(True)
        for n, p in stage.named_parameters()
        if id(p) not in ties
    }


def _gradients(stages, params, tied, x, y, loss_fn):  # type: ignore[no-untyped-def]
    activation = x
    for stage, weights in zip(stages, params, strict=True):
        for name, layer in stage.items():
            prefix = f"{name}."
            own = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
            for local, param in layer.named_parameters(remove_duplicate=False):
                if id(param) in tied:
                    own[local] = tied[id(param)]
            buffers = dict(layer.named_buffers())
            activation = functional_call(layer, {**own, **buffers}, (activation,))
    loss = loss_fn(activation, y)
    leaves = [list(p.values()) for p in params]
    flat = [leaf for group in leaves for leaf in group] + list(tied.values())
    found = torch.autograd.grad(loss, flat, allow_unused=True) if flat else ()
    out, position = [], 0
    for group, weights in zip(leaves, params, strict=True):
        names = list(weights)
        grads = found[position : position + len(group)]
        out.append({n: g for n, g in zip(names, grads, strict=True) if g is not None})
        position += len(group)
    tie_grads = {key: g for key, g in zip(tied, found[position:], strict=True) if g is not None}
    return out, tie_grads


def _apply(stage: nn.ModuleDict, optimizer, summed, size, ties, scale=1.0) -> None:  # type: ignore[no-untyped-def]
    if optimizer is None:
        return
    for name, param in stage.named_parameters():
        if id(param) in ties:
            continue
        param.grad = summed[name] / size if name in summed else None
    base = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, base, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _stage_delay(plan: Plan, sync: str, stage: int) -> int:
    s, first = plan.stages[stage], plan.stages[0]
    if sync == "async":
        return s.warmup
    if sync == "vertical_sync":
        return -(-(first.replicas * first.warmup) // s.replicas)
    return 0


def _delay_scale(tau: int, before: int, horizon: int | None) -> float:
    """The learning rate per delay's factor after ``before`` updates (None: off)."""
    if horizon is None:
        return 1.0
    if horizon == 0:
        return 1.0 / tau
    if before >= horizon:
        return 1.0
    return tau ** (before / horizon - 1.0)


def _extrapolate(current: dict, previous: dict, d: int) -> dict[str, torch.Tensor]:
    """W_v + d (W_v - W_(v-1)) as new leaves."""
    return {
        n: (w.detach() + d * (w.detach() - previous[n].detach())).requires_grad_(True)
        for n, w in current.items()
    }
