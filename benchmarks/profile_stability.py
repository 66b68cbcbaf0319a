"""How stable are ``profile_layers`` figures from one call to the next, and what does a call cost?

Profiles a small MLP and a small CNN five times each on one CPU thread and prints, per layer, the
median over the calls and the relative spread ``(max - min) / median`` of the forward and backward
times, then the wall time of one profiling call (the first call in a process is
cold, so it is reported apart).

Run: ``OMP_NUM_THREADS=1 python benchmarks/profile_stability.py``

Measured with that command on a 2-vCPU VM (torch 2.13 CPU, one thread, defaults ``warmup=2,
repeats=5``, five calls per model, spread = (max - min) / median of a layer's time over the five
calls, first call of the process included):

* MLP, 6 x (Linear 512 + ReLU), batch 64: a call takes 0.064 s (0.36 s for the first call of a
  process). Linear: forward 0.33 ms, spread 1-9%; backward 0.36-0.74 ms, spread 4-13% (one
  layer 56%). ReLU (0.006 / 0.024 ms): 4-23%.
* CNN, conv 32-64-128 with pooling and BatchNorm on 64 x 3 x 32 x 32: a call takes 0.41 s
  (0.49 s first). Convolutions: forward 1.2-3.0 ms, spread 2-5%; backward 1.3-6.3 ms, spread
  4-14%. MaxPool and BatchNorm (0.6-8 ms): 2-11%. Layers under 0.5 ms: 5-41%.

A call therefore costs about ``2 * warmup + repeats`` training steps of the model; layers above
~1 ms are reproducible to ~5-15%, and the noisy ones are the sub-0.5 ms layers that weigh little in
a stage. With the other cores busy, spreads grew to 50-280% on single layers (whole calls run 2x
slower), so profile on an otherwise idle machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from pl_pipedream.profile.graph import Profile  # noqa: E402
from pl_pipedream.profile.measure import profile_layers  # noqa: E402

NUM_CALLS = 5
BATCH_SIZE = 64


def mlp(width: int = 512, depth: int = 6) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def spread(values: list[float]) -> float:
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle > 0 else 0.0


def report(name: str, model: nn.Sequential, sample: torch.Tensor) -> None:
    profiles: list[Profile] = []
    walls: list[float] = []
    for _ in range(NUM_CALLS):
        start = time.perf_counter()
        profiles.append(profile_layers(model, sample))
        walls.append(time.perf_counter() - start)
    print(f"\n{name}: sample {tuple(sample.shape)}, {NUM_CALLS} calls")
    print("spread = (max - min) / median over all calls; warm = the same without the first call")
    print(
        f"{'layer':<8}{'desc':<26}{'fwd ms':>9}{'spread':>8}{'warm':>8}"
        f"{'bwd ms':>9}{'spread':>8}{'warm':>8}"
    )
    for i, node in enumerate(profiles[0].nodes):
        forward = [p.nodes[i].forward_ms for p in profiles]
        backward = [p.nodes[i].backward_ms for p in profiles]
        print(
            f"{node.node_id:<8}{node.desc[:24]:<26}"
            f"{statistics.median(forward):>9.4f}{spread(forward):>8.0%}{spread(forward[1:]):>8.0%}"
            f"{statistics.median(backward):>9.4f}{spread(backward):>8.0%}"
            f"{spread(backward[1:]):>8.0%}"
        )
    print(
        f"wall time of one call: first {walls[0]:.3f} s, later calls median "
        f"{statistics.median(walls[1:]):.3f} s (max {max(walls[1:]):.3f})"
    )


def main() -> None:
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    )
    report("MLP 6 x (Linear 512 + ReLU)", mlp(), torch.randn(BATCH_SIZE, 512))
    report("CNN 3 conv blocks", cnn(), torch.randn(BATCH_SIZE, 3, 32, 32))


if __name__ == "__main__":
    main()
