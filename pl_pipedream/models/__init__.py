"""Example LightningModules for ``pl-pipedream-train``: classifiers, sequence models and the
PipeDream paper's models (VGG-16, AlexNet, ResNet-50, GNMT-8/16, AWD-LM, S2VT), all listing their
layers.

Each model hands its layers to the strategy in order through ``configure_pipeline()``; the rest
(steps, metrics, optimizer) is shared by ``PipelineClassifier``.
"""

from __future__ import annotations

from pl_pipedream.models.awd_lm import AWDLM
from pl_pipedream.models.classifier import PipelineClassifier
from pl_pipedream.models.cnn import DigitsCNN
from pl_pipedream.models.gnmt import GNMT, GNMT8, GNMT16
from pl_pipedream.models.gpt import CharGPT
from pl_pipedream.models.imagenet import VGG16, AlexNet, ResNet50
from pl_pipedream.models.mlp import MLP
from pl_pipedream.models.s2vt import S2VT
from pl_pipedream.models.seq2seq import Seq2Seq

__all__ = [
    "AWDLM",
    "GNMT",
    "GNMT8",
    "GNMT16",
    "MLP",
    "VGG16",
    "AlexNet",
    "CharGPT",
    "DigitsCNN",
    "PipelineClassifier",
    "ResNet50",
    "S2VT",
    "Seq2Seq",
]
