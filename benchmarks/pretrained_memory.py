"""Peak memory per rank while fine-tuning GPT-2 (124M) from a Hugging Face checkpoint on 2 ranks.

Reproduces: ``PipeDreamStrategy(pretrained=...)`` with a module built in ``configure_model()``
keeps each rank's memory to its own stage; no rank builds or reads the whole model.
Hardware: CPU, 2 processes (gloo). Command:

    python benchmarks/pretrained_memory.py [--out /tmp/pretrained_memory] [--steps 2]
    python benchmarks/pretrained_memory.py --one-device   # the whole model in one process

It first writes, in a separate process, a GPT-2-shaped checkpoint as Hugging Face lays it out
(``model.safetensors``, Hugging Face's names, ``Conv1D`` weights, the ``attn.bias`` masks;
random values), then fine-tunes ``GPT2`` below from it (``sync="flush"``, balance [7, 7]: the
embedding and 6 blocks | 6 blocks and the head, which holds the tied embedding too; AdamW) and
prints per rank: its stage's bytes (parameters and buffers it holds), the whole model's bytes,
and the rise of the resident set (``VmHWM`` minus the resident set before the build, read from
``/proc/self/status``) over setup (build on ``meta`` and load) and over training (AdamW's two
moments and the gradients come on top of the weights). ``--one-device`` runs the same
fine-tuning in one process (``strategy="auto"``), the whole model loaded from the same file with
``safetensors.torch.load_file``, for comparison. Expected: the setup rise near the
stage's bytes and well below the whole model's; training near 4x the stage's (weights,
gradients, two moments) plus activations. The mapping of Hugging Face's names (``hf_name``,
``from_conv1d``) is the one docs/pretrained.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.pretrained import Pretrained

VOCAB, POSITIONS, WIDTH, HEADS, LAYERS = 50257, 1024, 768, 12, 12
CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def hf_name(name: str) -> str | None:
    """A Hugging Face GPT-2 name -> this module's (None: not loaded)."""
    name = name.removeprefix("transformer.")
    if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
        return None  # the causal masks (buffers), and the head tied to wte
    if name.startswith(("wte.", "wpe.")):
        return "embed." + name
    if name.startswith("ln_f."):
        return "head." + name
    return name


def from_conv1d(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``Conv1D`` stores ``nn.Linear``'s weight transposed."""
    return tensor.t() if name.endswith(CONV1D) else tensor


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(POSITIONS, WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        shape = (batch, length, HEADS, WIDTH // HEADS)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(batch, length, WIDTH))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.ln_2, self.mlp = nn.LayerNorm(WIDTH), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT2(LightningModule):
    """GPT-2 small under names that ``hf_name`` maps Hugging Face's onto, built empty."""

    def __init__(self, load_whole: Path | None = None) -> None:
        super().__init__()
        self.embed: Embed | None = None
        self.load_whole = load_whole  # one device: load the whole file here, as users do

    def configure_model(self) -> None:
        if self.embed is not None:
            return
        self.embed = Embed()
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = Head()
        self.head.lm_head.weight = self.embed.wte.weight  # tied, as GPT-2 ties them
        if self.load_whole is not None:
            from safetensors.torch import load_file

            state = load_file(self.load_whole)
            mapped = {hf_name(n): from_conv1d(n, t) for n, t in state.items() if hf_name(n)}
            self.load_state_dict(mapped, strict=False)  # head.lm_head.weight: the tie

    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.embed, *self.h, self.head)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(nn.Sequential(*self.h)(self.embed(tokens)))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        tokens, targets = batch
        return F.cross_entropy(self(tokens).reshape(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


def hf_layout() -> dict[str, tuple[int, ...]]:
    """The names and shapes of Hugging Face's GPT-2 small ``model.safetensors``."""
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (VOCAB, WIDTH)}
    shapes["wpe.weight"] = (POSITIONS, WIDTH)
    block = {
        "ln_1.weight": (WIDTH,), "ln_1.bias": (WIDTH,), "attn.bias": (1, 1, POSITIONS, POSITIONS),
        "attn.c_attn.weight": (WIDTH, 3 * WIDTH), "attn.c_attn.bias": (3 * WIDTH,),
        "attn.c_proj.weight": (WIDTH, WIDTH), "attn.c_proj.bias": (WIDTH,),
        "ln_2.weight": (WIDTH,), "ln_2.bias": (WIDTH,),
        "mlp.c_fc.weight": (WIDTH, 4 * WIDTH), "mlp.c_fc.bias": (4 * WIDTH,),
        "mlp.c_proj.weight": (4 * WIDTH, WIDTH), "mlp.c_proj.bias": (WIDTH,),
    }  # fmt: skip
    for i in range(LAYERS):
        shapes.update({f"h.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({"ln_f.weight": (WIDTH,), "ln_f.bias": (WIDTH,)})
    return shapes


def write_checkpoint(directory: Path) -> None:
    """A GPT-2-shaped ``model.safetensors`` as Hugging Face writes it (random values)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in hf_layout().items():
        if name.endswith(".attn.bias"):
            state[name] = torch.tril(torch.ones(shape))  # the causal mask
        elif ".ln_" in name or name.startswith("ln_f."):
            state[name] = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        elif name.endswith(".bias"):
            state[name] = torch.zeros(shape)
        else:
            state[name] = torch.randn(shape, generator=generator) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})


def memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


class Measure(Callback):
    """The resident set before the build, its peak over setup and over training."""

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        reset_peak()  # runs just before configure_model()
        self.base = memory_kib("VmRSS")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.figures["setup_rise_mib"] = (memory_kib("VmHWM") - self.base) / 1024
        self.start = time.perf_counter()
        reset_peak()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.figures["train_rise_mib"] = (memory_kib("VmHWM") - self.base) / 1024
        self.figures["train_seconds"] = time.perf_counter() - self.start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/pretrained_memory")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--length", type=int, default=64, help="tokens per example")
    parser.add_argument("--write", action="store_true", help="only write the checkpoint")
    parser.add_argument("--one-device", action="store_true", help="the whole model, 1 process")
    args = parser.parse_args()
    out, rank = Path(args.out), int(os.environ.get("LOCAL_RANK", "0"))
    weights = out / "gpt2"
    if args.write:
        return write_checkpoint(weights)
    if rank == 0:
        for old in out.glob("rank*.json"):
            old.unlink()
        if not (weights / "model.safetensors").is_file():
            subprocess.run([sys.executable, __file__, "--write", "--out", str(out)], check=True)
    generator = torch.Generator().manual_seed(0)  # the same batches on every rank
    tokens = torch.randint(0, VOCAB, (4 * args.steps, args.length + 1), generator=generator)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    spec = Pretrained(weights, rename=hf_name, convert=from_conv1d)
    strategy = PipeDreamStrategy(sync="flush", balance=[7, 7], microbatches=2, pretrained=spec)
    measure = Measure()
    trainer = Trainer(
        strategy="auto" if args.one_device else strategy, accelerator="cpu",
        devices=1 if args.one_device else 2, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[measure],
    )  # fmt: skip
    model = GPT2(weights / "model.safetensors" if args.one_device else None)
    trainer.fit(model, data)
    if args.one_device:
        rank = 2  # reported as "one device"
        held = model.state_dict(keep_vars=True).values()
    else:
        assert strategy.session is not None and strategy.session.local is not None
        held = strategy.session.local.module.state_dict(keep_vars=True).values()
    stage = sum(t.nbytes for t in {id(t): t for t in held}.values())
    every = model.state_dict(keep_vars=True).values()  # other stages' on meta: no memory
    whole = sum(t.nbytes for t in {id(t): t for t in every}.values())
    figures = {"rank": rank, "stage_mib": stage / 2**20, "whole_mib": whole / 2**20}
    figures |= measure.figures
    (out / f"rank{rank}.json").write_text(json.dumps(figures))
    if rank == 0:
        report(out, [0, 1])
    if rank == 2:
        report(out, [2])


def report(out: Path, ranks: list[int]) -> None:
    deadline = time.time() + 120
    while not all((out / f"rank{r}.json").is_file() for r in ranks) and time.time() < deadline:
        time.sleep(0.5)
    print("    rank  stage MiB  whole model MiB  setup rise MiB  train rise MiB  train s")
    for rank in ranks:
        f = json.loads((out / f"rank{rank}.json").read_text())
        name = "1 device" if rank == 2 else f"{rank:>8}"
        print(
            f"{name}  {f['stage_mib']:>9.0f}  {f['whole_mib']:>15.0f}  "
            f"{f['setup_rise_mib']:>14.0f}  {f['train_rise_mib']:>14.0f}  "
            f"{f['train_seconds']:>7.1f}"
        )


if __name__ == "__main__":
    main()
