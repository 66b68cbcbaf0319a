"""``ResumableLoader``: a training DataLoader that a checkpoint taken mid-epoch resumes exactly.

Lightning saves a training loader's ``state_dict`` with the fit's loops and, when a fit resumes,
hands it back through ``load_state_dict``; a loader without them starts the interrupted epoch
again from its first batch (Lightning warns that this "can cause unreliable results"). This one
records how many batches the current epoch has given out and the state of its generator when the
epoch began (the generator draws the epoch's order: the ``RandomSampler``'s permutation and the
workers' base seed). Resumed mid-epoch it draws the same order again and skips the batches given
out before; resumed at an epoch's end it goes on with its generator as it was, so the next epoch
draws what it would have drawn. A preempted ``pl-pipedream-train`` run resumed with
``ckpt_path=last`` thus trains on the batches the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor
from torch.utils.data import DataLoader

__all__ = ["ResumableLoader"]


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` with a ``state_dict``: batches given out this epoch, and its order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._given = 0  # batches given out in the current epoch
        self._skip = 0  # batches the next epoch skips (a resumed one)
        self._began: Tensor | None = None  # the generator's state when the epoch began
        self._restore: Tensor | None = None  # the generator's state for the next epoch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self._restore is not None and self.generator is not None:
            self.generator.set_state(self._restore)
        self._restore = None
        self._began = None if self.generator is None else self.generator.get_state()
        skip, self._skip, self._given = self._skip, 0, 0
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self._given = index + 1
                yield batch

    def state_dict(self) -> dict[str, Any]:
        now = None if self.generator is None else self.generator.get_state()
        return {"given": self._given, "began": self._began, "now": now}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        given = int(state["given"])
        if 0 < given < len(self):  # mid-epoch: this epoch's order again, minus what was given
            self._skip, self._restore = given, state["began"]
        else:
            self._skip, self._restore = 0, state["now"]
