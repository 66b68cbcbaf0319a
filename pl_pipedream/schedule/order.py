"""The order of forwards, backwards and updates on one replica, before messages are added.

An order is a list of ``Token``: ``("F", i)`` and ``("B", i)`` for minibatch ``i``, ``("U", u)``
for update ``u``. 1F1B (SOSP'19 section 3.2) runs as three pieces: a warm-up of ``w`` forwards,
a steady state that alternates one forward with the backward ``w`` minibatches behind it, and a
drain of the last ``w`` backwards. The asynchronous modes run it once over all of a replica's
minibatches, the flushed mode once per batch; GPipe runs all forwards of a batch, then all
backwards. A mode that splits the backward (zero bubble) runs ``("I", i)`` where 1F1B runs
``("B", i)`` and the weight half ``("W", i)`` later: ``split_one_f_one_b`` holds back the first
``lag`` of them, so that they fill the drain's bubble (ZB-H1, Qi et al., ICLR'24, section 3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["Token", "forwards_first", "one_f_one_b", "split_one_f_one_b", "with_updates"]

Token = tuple[str, int]
_WEIGHT_GRADS = ("B", "W")  # the tokens whose weight gradients go into an update


def warmup(minibatches: Sequence[int], num_warmup: int) -> list[Token]:
    """The first ``num_warmup`` forwards, admitted before any backward."""
    return [("F", i) for i in minibatches[:num_warmup]]


def steady(minibatches: Sequence[int], num_warmup: int) -> list[Token]:
    """One forward, then the backward of the minibatch ``num_warmup`` places behind it."""
    tokens: list[Token] = []
    for n in range(num_warmup, len(minibatches)):
        tokens.append(("F", minibatches[n]))
        tokens.append(("B", minibatches[n - num_warmup]))
    return tokens


def drain(minibatches: Sequence[int], num_warmup: int) -> list[Token]:
    """The backwards still owed once no forward is left."""
    return [("B", i) for i in minibatches[len(minibatches) - num_warmup :]]


def one_f_one_b(minibatches: Sequence[int], num_warmup: int) -> list[Token]:
    """Warm-up, steady 1F1B, drain over ``minibatches`` (one replica's, in order)."""
    num_warmup = min(num_warmup, len(minibatches))
    return (
        warmup(minibatches, num_warmup)
        + steady(minibatches, num_warmup)
        + drain(minibatches, num_warmup)
    )


def split_one_f_one_b(minibatches: Sequence[int], num_warmup: int, lag: int) -> list[Token]:
    """1F1B with each backward split: ``I`` where 1F1B runs ``B``, and the ``W`` of the minibatch
    ``lag`` places behind it right after each ``I``; the ``lag`` weight halves still owed end
    the list.

    A minibatch holds its activations from its forward to its ``W``, so a replica with ``w``
    warm-up forwards holds at most ``w + 1 + lag``: ``lag = (p - 1) - w`` keeps every stage of a
    straight pipeline at 1F1B's peak, ``p`` (the input stage's).
    """
    tokens: list[Token] = []
    owed = 0  # the index, in ``minibatches``, of the next weight half
    done = 0  # input halves run so far
    for kind, i in one_f_one_b(minibatches, num_warmup):
        if kind == "F":
            tokens.append(("F", i))
            continue
        tokens.append(("I", i))
        done += 1
        while owed < done - lag:
            tokens.append(("W", minibatches[owed]))
            owed += 1
    return tokens + [("W", i) for i in minibatches[owed:]]


def forwards_first(minibatches: Sequence[int]) -> list[Token]:
    """All forwards, then all backwards in the same order (GPipe)."""
    return [("F", i) for i in minibatches] + [("B", i) for i in minibatches]


def with_updates(tokens: Sequence[Token], update_of: Callable[[int], int]) -> list[Token]:
    """Insert update ``u`` right after the replica's last backward that feeds it.

    A weight gradient comes from a ``B`` token, or a ``W`` one in a split order. Backwards reach
    each replica in minibatch order and an update covers consecutive minibatches,
    so the last backward of an update is the one whose next backward feeds a later update.
    """
    backwards = [i for kind, i in tokens if kind in _WEIGHT_GRADS]
    last = {update_of(i): i for i in backwards}
    closing = {i: u for u, i in last.items()}
    out: list[Token] = []
    for kind, i in tokens:
        out.append((kind, i))
        if kind in _WEIGHT_GRADS and i in closing:
            out.append(("U", closing[i]))
    return out
