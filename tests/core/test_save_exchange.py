"""The messages of one save among its writers (``core.save_exchange``): a lone writer needs
none, and two writers agree on the token, gather the records in stage order and share the
outcome. A writer killed mid-save is tested through a whole fit in
``tests/core/test_checkpoint.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pl_pipedream.core.errors import CheckpointError
from pl_pipedream.core.save_exchange import SaveExchange
from tests.runtime.distributed import run


def test_a_lone_writer_leads_and_exchanges_nothing(tmp_path: Path) -> None:
    exchange = SaveExchange(0, [0], 5.0, tmp_path)
    assert exchange.leads
    assert exchange.token()
    assert exchange.records({"file": "stage-00.pt"}, {0: 0}) == [{"file": "stage-00.pt"}]
    exchange.outcome()  # nobody to tell


def exchange_on(rank: int, world: int, path: Path, error: str | None) -> Any:
    exchange = SaveExchange(rank, [0, 1], 20.0, path)
    token = exchange.token()
    records = exchange.records({"file": f"shard-of-rank-{rank}"}, {0: 1, 1: 0})
    try:
        exchange.outcome(error if exchange.leads else None)
    except CheckpointError as raised:
        return token, records, str(raised)
    return token, records, None


@pytest.mark.slow
def test_two_writers_agree_on_the_token_and_the_lead_gathers_records_in_stage_order(
    tmp_path: Path,
) -> None:
    results = run(2, exchange_on, tmp_path, "disk full")
    assert {status for status, _ in results.values()} == {"ok"}, results
    (token0, records0, error0), (token1, records1, error1) = results[0][1], results[1][1]
    assert token0 == token1
    assert records0 == [{"file": "shard-of-rank-1"}, {"file": "shard-of-rank-0"}]  # stage order
    assert records1 == []
    assert (error0, error1) == (None, "disk full")  # the lead tells; the other raises it
