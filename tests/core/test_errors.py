"""The one module of errors: each class keeps the built-in base callers catch it by."""

from __future__ import annotations

import pytest

from pl_pipedream.core import errors


@pytest.mark.parametrize(
    ("name", "base"),
    [
        ("PipelineSetupError", ValueError),
        ("PipelineDataError", ValueError),
        ("OtherStageParameterError", ValueError),
        ("CheckpointError", ValueError),
        ("TrainingDiverged", RuntimeError),
        ("BadData", RuntimeError),
        ("LightningChangedError", RuntimeError),
    ],
)
def test_each_error_keeps_its_built_in_base(name: str, base: type) -> None:
    assert issubclass(getattr(errors, name), base) and name in errors.__all__


def test_bad_data_is_a_kind_of_divergence() -> None:
    assert issubclass(errors.BadData, errors.TrainingDiverged)
