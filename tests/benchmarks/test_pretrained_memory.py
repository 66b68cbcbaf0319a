"""``benchmarks/pretrained_memory.py``: the Hugging Face GPT-2 mapping that docs/pretrained.md
shows takes every tensor of GPT-2 small's ``model.safetensors`` layout onto ``GPT2``'s names and
shapes (checked on ``meta``, nothing allocated); the benchmark itself is run by hand."""

from __future__ import annotations

import torch
from pretrained_memory import GPT2, from_conv1d, hf_layout, hf_name

from pl_pipedream.core.materialize import EmptyBuild
from pl_pipedream.core.pretrained import Pretrained, WeightsFile, match


def test_hugging_face_gpt2_names_map_onto_the_module() -> None:
    model = GPT2()
    with EmptyBuild().record():
        model.configure_model()
    shapes = {name: torch.empty(shape, device="meta") for name, shape in hf_layout().items()}
    weights = WeightsFile(shapes, lambda: shapes.__getitem__)
    found = match(model, weights, Pretrained("gpt2", rename=hf_name, convert=from_conv1d))
    assert len(found) == len({id(t) for t in model.state_dict(keep_vars=True).values()})
    assert found[id(model.head.lm_head.weight)] == ["wte.weight"]  # the tie, from wte
    assert sum(t.numel() for t in model.parameters()) == 124_439_808  # GPT-2 small
