"""``reproduce.table``: Table 1's rows read from a CSV, selected by id, with clear errors."""

from __future__ import annotations

import pytest

from pl_pipedream.reproduce.table import PROFILE_OF, ReproduceError, Row, read_table, select

TOY = (
    "# comment\n"
    "model,task,dataset,target,cluster,servers,gpus_per_server,pipedream_config,"
    "speedup_epoch_time,speedup_time_to_accuracy\n"
    "Toy,x,y,z,A,1,4,,,\n"
    "Toy,x,y,z,C,4,1,2-1-1,3,\n"
    "Toy,x,y,z,B,2,8,,,2.5\n"
)


def test_a_made_up_table_is_read_then_the_unchecked_rows_follow(tmp_path) -> None:
    table = tmp_path / "table1.csv"
    table.write_text(TOY)
    rows = read_table(table)
    assert [row.id for row in rows[:3]] == ["toy_A_1x4", "toy_C_4x1", "toy_B_2x8"]
    assert rows[0].config is None and rows[0].paper_speedup is None
    assert rows[1].config == "2-1-1" and rows[1].paper_speedup == (3.0, "epoch")
    assert rows[2].paper_speedup == (2.5, "TTA")
    assert [row.id for row in rows[3:]] == ["gnmt8_A_1x4", "gnmt8_A_3x4", "gnmt8_B_2x8"]


def test_the_shipped_table_has_the_paper_rows_and_their_profiles() -> None:
    rows = read_table()
    by_id = {row.id: row for row in rows}
    assert by_id["vgg16_A_4x4"] == Row("VGG-16", "A", 4, 4, "15-1", 5.28, 5.28)
    assert {row.model for row in rows} >= set(PROFILE_OF)


def test_rows_are_selected_by_id_in_the_order_given() -> None:
    rows = read_table()
    assert select(rows, ["all"]) == rows and select(rows, []) == rows
    chosen = select(rows, ["ALEXNET_A_4x4", "vgg16_A_4x4"])
    assert [row.id for row in chosen] == ["alexnet_A_4x4", "vgg16_A_4x4"]
    with pytest.raises(ReproduceError, match=r"\(row: vgg19_A_4x4\); use all or one of"):
        select(rows, ["vgg19_A_4x4"])


def test_a_missing_table_names_the_option(tmp_path) -> None:
    with pytest.raises(ReproduceError, match=r"\(--table: .*missing.csv\); pass --table PATH"):
        read_table(tmp_path / "missing.csv")
