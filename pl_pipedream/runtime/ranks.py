"""How an error names where it happened: ``describe(1, 1)`` is ``"rank 1 (stage 1)"``.

Runtime errors name the rank and its stage (STYLE.md); every module that builds that text calls
``describe``, so that the user meets one form, whichever layer raised. An exchange with another
rank that failed (a message of the channel, a replica all-reduce) is worded once, by
``peer_failure``: it names the peer, not the address and port the backend reports; a collective
over several ranks (a stage's replicas, a tie's holders), by ``group_failure``.
"""

from __future__ import annotations

import re

__all__ = ["backend_detail", "describe", "group_failure", "peer_failure"]


def describe(rank: int, stage: int | None = None) -> str:
    """``"rank 1 (stage 1)"``, or ``"rank 1"`` where the stage is not known."""
    return f"rank {rank}" if stage is None else f"rank {rank} (stage {stage})"


def backend_detail(cause: BaseException) -> str:
    """The backend's reason in a few words: the first sentence of its first line, without
    the source file it was raised in and the peer's address ("Connection closed by peer"
    from gloo's "[.../pair.cc:553] Connection closed by peer [127.0.0.1]:2549. This is...")."""
    text = str(cause).strip()
    if not text:
        return type(cause).__name__
    line = re.sub(r"^\[?[^\]\s]*:\d+\]\s*", "", text.splitlines()[0])
    line = re.sub(r"\s*\[[0-9A-Fa-f.:]+\]:\d+", "", line)
    return line.split(". ")[0].rstrip(".") or type(cause).__name__


def peer_failure(
    attempt: str,
    peer: str,
    cause: BaseException,
    waited: float | None,
    timeout: float | None,
) -> str:
    """What a failed exchange with ``peer`` (``describe``'s text) means, in the user's terms:
    the deadline passed (the peer may be slow or stuck), or the peer's connection closed before
    it (the peer has stopped: its own error is the one to read). ``attempt`` says what failed
    ("rank 1 (stage 1) could not receive ... from rank 2"); ``waited`` is None when the
    operation failed as it was posted; ``timeout`` is the deadline, if there is one."""
    detail = backend_detail(cause)
    if waited is not None and timeout is not None and waited >= 0.95 * timeout:
        return (
            f"{attempt} within {timeout:g} s ({detail}); {peer} has probably failed or "
            f"stopped: look for its error above, or raise the timeout "
            f"(timeout=..., the same argument in every front end) if its stage is just slow"
        )
    after = "as it was posted" if waited is None else f"after {waited:.1f} s of waiting"
    return (
        f"{attempt}: the connection was closed by {peer} {after} ({detail}); {peer} has "
        f"stopped: look for its error above (or in its log)"
    )


def group_failure(
    who: str,
    what: str,
    kind: str,
    others: list[str],
    cause: BaseException,
    waited: float | None,
    timeout: float | None,
) -> str:
    """``who`` could not sum ``what`` in a collective with ``others`` (``describe``'s texts; each
    one of ``who``'s ``kind``, e.g. "replica"): the backend does not say which of several
    stopped, so with more than one, each is named as a candidate."""
    if len(others) == 1:
        peer = others[0]
        attempt = f"{who} could not sum {what} with its {kind} {peer}"
    else:
        peer = f"one of {', '.join(others)}"
        attempt = f"{who} could not sum {what} with its {kind}s ({', '.join(others)})"
    return peer_failure(attempt, peer, cause, waited, timeout)
