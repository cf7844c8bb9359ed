"""The item catalogue's files (model/catalogue.py): CSV and JSON lines, MovieLens-100K's u.item, the
artifact's copy, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.artifact import load_artifact
from model.catalogue import (
    CatalogueError,
    ItemRecord,
    load_catalogue,
    read_items,
    read_movielens_items,
    write_catalogue,
)
from tests.conftest import DATASETS


def test_json_lines_and_csv_read_the_same_records(tmp_path: Path) -> None:
    jsonl = tmp_path / "items.jsonl"
    jsonl.write_text(
        '{"item": "a", "title": "A", "categories": ["x", "y", "x"], "attributes": {"year": 1995, '
        '"price": 9.5, "new": true, "lang": "en"}}\n\n{"item": "b", "hidden": true}\n'
    )
    csv = tmp_path / "items.csv"
    csv.write_text("item,title,categories,hidden,year,price,new,lang\na,A,x|y,,1995,9.5,true,en\nb,,,1,,,,\n")
    from_json, from_csv = read_items(jsonl), read_items(csv)
    assert from_json == from_csv
    assert list(from_json) == ["a", "b"]
    a = from_json["a"]
    assert a.categories == ["x", "y"]  # a duplicate dropped, order kept
    assert a.attributes == {"year": 1995, "price": 9.5, "new": True, "lang": "en"}
    assert isinstance(a.attributes["year"], int) and isinstance(a.attributes["new"], bool)
    assert from_json["b"] == ItemRecord(hidden=True)


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("items.jsonl", '{"item": "a"}\n{"item": "a"}\n', "items.jsonl:2: item 'a' appears twice"),
        ("items.jsonl", '{"item": "a"}\nnot json\n', "items.jsonl:2: not JSON"),
        ("items.jsonl", '{"item": "a", "colour": "red"}\n', "items.jsonl:1: colour: Extra inputs"),
        ("items.jsonl", '{"item": "a", "attributes": {"1x": 1}}\n', "attribute name '1x'"),
        ("items.jsonl", '{"item": "a", "attributes": {"x": {"y": 1}}}\n', "items.jsonl:1: attributes.x"),
        ("items.jsonl", '{"title": "no id"}\n', "items.jsonl:1: `item` must be an id"),
        ("items.csv", "id,title\n1,A\n", "items.csv:1: the header must name an `item` column"),
        ("items.csv", "item,hidden\n1,maybe\n", "items.csv:2: hidden must be true or false"),
        ("items.csv", "item,title\n1,A,extra\n", "items.csv:2: more cells than the header names"),
        ("items.txt", "a\n", "a catalogue is a .csv or .jsonl file"),
    ],
)
def test_a_bad_file_says_where_and_what(tmp_path: Path, name: str, text: str, says: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(CatalogueError, match=None) as err:
        read_items(path)
    assert says in str(err.value)


def test_movielens_u_item_gives_titles_genres_and_years() -> None:
    records = read_movielens_items(DATASETS / "ml-100k")
    if records is None:
        pytest.skip(f"no ml-100k/u.item under {DATASETS}")
    assert len(records) == 1682
    toy = records["1"]
    assert toy.title == "Toy Story (1995)"
    assert toy.categories == ["Animation", "Children's", "Comedy"]
    assert toy.attributes == {"year": 1995}
    assert records["267"].attributes == {}  # the one film without a release date
    assert any("é" in (r.title or "") for r in records.values())  # Latin-1 read as such


def test_the_artifact_keeps_the_catalogue_it_was_trained_with(synthetic_csv: Path, tmp_path: Path) -> None:
    from training.pipeline import run_training

    items = tmp_path / "items.jsonl"
    records = {str(j): ItemRecord(categories=["odd" if j % 2 else "even"], hidden=j == 3) for j in range(20)}
    records["not-rated"] = ItemRecord(title="in the catalogue only")
    write_catalogue(tmp_path, records)
    (tmp_path / "items.jsonl").rename(items)
    out = tmp_path / "artifact"
    run_training("csv", synthetic_csv, out, split="random", preset_name="tiny", progress=False, items=items)
    art = load_artifact(out)
    assert art.catalogue == records
    assert load_catalogue(out / "items.jsonl") == records
    assert "items.jsonl" in json.loads((out / "manifest.json").read_text())["files"]


def test_training_refuses_a_bad_catalogue_before_it_trains(synthetic_csv: Path, tmp_path: Path) -> None:
    from training.cli import main

    bad = tmp_path / "items.csv"
    bad.write_text("item,hidden\n1,perhaps\n")
    out = tmp_path / "artifact"
    argv = ["train", "--dataset", "csv", "--data-dir", str(synthetic_csv), "--out", str(out)]
    assert main([*argv, "--split", "random", "--preset", "tiny", "--items", str(bad)]) == 2
    assert not out.exists()
