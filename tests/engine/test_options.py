"""A pipeline's options are ``Pipeline``'s keyword arguments; a front end passes them on and
checks them when it is made, with the fix in its own spelling."""

from __future__ import annotations

import inspect

import pytest

from pl_pipedream import Pipeline
from pl_pipedream.engine.options import checked_options, option_defaults
from pl_pipedream.schedule.modes import SyncMode

CALL = "Front({args})"


def test_the_options_are_pipelines_keyword_arguments_with_their_defaults() -> None:
    defaults = option_defaults()
    parameters = inspect.signature(Pipeline.__init__).parameters
    assert list(defaults) == [
        n for n in parameters if n not in ("self", "layers", "loss_fn", "optimizer")
    ]
    assert defaults["sync"] == SyncMode.FLUSH and defaults["microbatches"] == 1
    assert defaults["divergence_window"] == 5 and defaults["replan"] == "off"


def test_good_options_come_back_with_the_mode() -> None:
    options, mode = checked_options({"sync": "2bw", "microbatches": 4}, CALL)
    assert options == {"sync": "2bw", "microbatches": 4} and mode is SyncMode.TWO_BW


def test_an_unknown_option_or_one_the_framework_sets_is_refused_naming_the_others() -> None:
    with pytest.raises(TypeError, match=r"^Front\(\.\.\.\) takes the options of pl_pipedream"):
        checked_options({"microbatch": 4}, CALL)
    with pytest.raises(TypeError) as error:
        checked_options({"device": "cpu"}, CALL, owned=("device", "precision"))
    text = str(error.value)
    assert "(unknown: device); use sync, microbatches," in text
    assert text.endswith("; device, precision come from the framework")


def test_a_bad_value_is_refused_in_the_front_ends_spelling() -> None:
    with pytest.raises(ValueError, match=r"for example Front\(microbatches=4\)$"):
        checked_options({"microbatches": 0}, CALL)
    with pytest.raises(ValueError, match=r'for example Front\(\.\.\., replan="auto"\)$'):
        checked_options({"replan": "sometimes"}, CALL)
