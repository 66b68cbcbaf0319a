"""Validation, test and predict: forward-only through the first replica of every stage.

The pipeline is drained before evaluation starts, so evaluation messages never mix with training
ones. Each batch goes through the stages in order (``core.evaluation.ForwardPipe``); the last
stage runs the user's hook (``validation_step``, ...) with ``self(x)`` returning the pipeline's
output. Predictions travel from the last stage to every other rank, so that ``trainer.predict``
returns them on every rank. Metrics the last stage logged are shared with every rank
(``lightning_patches.share_evaluation_metrics``),
because callbacks such as ``ModelCheckpoint`` and ``EarlyStopping`` monitor them on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch import nn

from pl_pipedream.core.evaluation import ForwardPipe
from pl_pipedream.engine.session import Session
from pl_pipedream.strategy.batches import first_stage_input, forward_returns

__all__ = ["EvaluationPipe", "evaluation_step"]


class EvaluationPipe(ForwardPipe):
    """One rank's part of forward-only evaluation (``core.evaluation.ForwardPipe``) with the
    LightningModule's hooks at the last stage."""

    def run(
        self,
        module: nn.Module,
        hook: str,
        batch: Any,
        batch_idx: int,
        *rest: Any,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
        **kwargs: Any,
    ) -> Any:
        """Run this stage's layers on the batch; the last stage returns the user's ``hook``.
        The layers and the hook run in ``context()`` (the precision plugin's step context)."""

        def finish(output: Any) -> Any:
            with context(), forward_returns(module, output):
                return getattr(module, hook)(batch, batch_idx, *rest, **kwargs)

        what = f"the {hook.split('_')[0]} activations of batch {batch_idx}"
        return self.forward(lambda: first_stage_input(module, batch), finish, what, context)

    def predictions_to_every_rank(self, result: Any, batch_idx: int) -> Any:
        """The last stage's predictions, on every rank, so that ``trainer.predict`` returns the
        same list everywhere, as a user of ``DDPStrategy`` expects each rank to get its own."""
        return self.to_every_rank(result, f"the predictions of batch {batch_idx}")


def evaluation_step(
    session: Session | None,
    precision: Precision,
    module: nn.Module | None,
    hook: str,
    batch: Any,
    batch_idx: int = 0,
    *rest: Any,
    **kwargs: Any,
) -> Any:
    """The strategy's ``validation_step``, ``test_step`` or ``predict_step`` (``hook``): the
    batch through the ``session``'s ``EvaluationPipe``, in the ``precision`` plugin's step
    context as in Lightning's own steps; predictions reach every rank."""
    pipe = session.forward if session is not None else None
    assert isinstance(pipe, EvaluationPipe) and module is not None
    context = getattr(precision, _CONTEXTS[hook])
    result = pipe.run(module, hook, batch, batch_idx, *rest, context=context, **kwargs)
    if hook == "predict_step":
        return pipe.predictions_to_every_rank(result, batch_idx)
    return result


_CONTEXTS = {
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}
