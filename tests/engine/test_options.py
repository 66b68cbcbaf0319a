"""A pipeline's options are ``Pipeline``'s keyword arguments; a front end passes them on and
checks them when it is made, with the fix in its own spelling."""

from __future__ import annotations

import inspect

import pytest

from pl_pipedream import Pipeline
from pl_pipedream.engine.options import FRONT_ENDS, FrontEnd, checked_options, option_defaults
from pl_pipedream.schedule.modes import SyncMode

FRONT = FrontEnd("Front({args})", {"device": "Front(devices=...)", "precision": "the flag"})


def test_the_options_are_pipelines_keyword_arguments_with_their_defaults() -> None:
    defaults = option_defaults()
    parameters = inspect.signature(Pipeline.__init__).parameters
    assert list(defaults) == [
        n for n in parameters if n not in ("self", "layers", "loss_fn", "optimizer")
    ]
    assert defaults["sync"] == SyncMode.FLUSH and defaults["microbatches"] == 1
    assert defaults["divergence_window"] == 5 and defaults["replan"] == "off"


def test_good_options_come_back_with_the_mode() -> None:
    options, mode = checked_options({"sync": "2bw", "microbatches": 4}, FRONT)
    assert options == {"sync": "2bw", "microbatches": 4} and mode is SyncMode.TWO_BW


def test_an_unknown_option_or_one_the_framework_sets_is_refused_naming_the_others() -> None:
    with pytest.raises(TypeError, match=r"^Front\(\.\.\.\) takes the options of pl_pipedream"):
        checked_options({"microbatch": 4}, FRONT)
    with pytest.raises(TypeError) as error:
        checked_options({"device": "cpu"}, FRONT)
    assert str(error.value) == (
        "Front(...) leaves these options to its framework (given: device); set them there "
        "(device: Front(devices=...))"
    )


def test_a_bad_value_is_refused_in_the_front_ends_spelling() -> None:
    with pytest.raises(ValueError, match=r"for example Front\(microbatches=4\)$"):
        checked_options({"microbatches": 0}, FRONT)
    with pytest.raises(ValueError, match=r'for example Front\(\.\.\., replan="auto"\)$'):
        checked_options({"replan": "sometimes"}, FRONT)


def test_each_front_end_takes_every_option_its_framework_does_not_decide() -> None:
    """``PipeDreamStrategy`` names the options in its signature: every ``Pipeline`` option but
    those Lightning decides, with ``Pipeline``'s defaults but those ``FRONT_ENDS`` lists; the
    front ends that pass ``**options`` on take exactly the options their framework leaves."""
    from pl_pipedream import PipeDreamStrategy

    pipeline = option_defaults()
    trainer = FRONT_ENDS["PipeDreamStrategy"]
    parameters = inspect.signature(PipeDreamStrategy.__init__).parameters
    taken = {name: p.default for name, p in parameters.items() if name in pipeline}
    assert sorted(set(pipeline) - set(taken)) == sorted(trainer.decides)
    differ = {name: d for name, d in taken.items() if d != pipeline[name]}
    assert differ == dict(trainer.defaults)
    for name in ("Fabric", "Accelerate"):
        assert set(FRONT_ENDS[name].decides) < set(pipeline) and not FRONT_ENDS[name].defaults


def test_an_option_lightning_decides_is_refused_by_the_strategy_naming_where_to_set_it() -> None:
    from pl_pipedream import PipeDreamStrategy

    with pytest.raises(TypeError, match=r"\(clip_grad_norm: Trainer\(gradient_clip_val=\.\.\."):
        PipeDreamStrategy(clip_grad_norm=1.0)
    with pytest.raises(TypeError, match=r"takes the options of pl_pipedream.Pipeline \(unknown"):
        PipeDreamStrategy(microbatch=4)
