"""Hugging Face Accelerate front end: ``prepare_pipeline(accelerator, model, optimizer, loss_fn)``.

A thin adapter over the plain engine (``pl_pipedream.Pipeline``): the Accelerator supplies the
process group it started, the device and the mixed-precision setting; ``accelerator.save_state``
and ``load_state`` save and restore the pipeline through Accelerate's state hooks. Nothing here
imports Lightning.
"""

from pl_pipedream.accelerate.prepare import prepare_pipeline

__all__ = ["prepare_pipeline"]
