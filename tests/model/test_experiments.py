"""Experiments on live traffic (model/experiments.py): assignment by a keyed hash (balanced, the same in
every process, reshuffled by the salt), the experiments file and what it refuses, when an experiment runs,
team-draft interleaving, and the results read from impressions and feedback (attribution, the figures,
their intervals, an A/A simulation, interleaving's preference, the report)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.experiments import (
    ExperimentError,
    ExperimentSpec,
    Feedback,
    Impression,
    parse_feedback,
    parse_impression,
    read_experiments,
    report_table,
    results,
    team_draft,
    unit,
)

REPO = Path(__file__).resolve().parents[2]
LEVELS = [1.0, 2.0, 3.0, 4.0, 5.0]
CHI2_999 = {1: 10.828, 2: 13.816}
"""The 0.999 quantiles of the chi-square distribution (df 1, 2), from a table: used without scipy."""


def _spec(**fields: Any) -> ExperimentSpec:
    weights = fields.pop("weights", (1.0, 1.0))
    names = fields.pop("names", [f"v{k}" for k in range(len(weights))])
    raw = {"id": "exp", "salt": "s1", **fields}
    raw["variant"] = [{"name": n, "weight": w} for n, w in zip(names, weights, strict=True)]
    return ExperimentSpec.model_validate(raw)


def _chi2_quantile(df: int) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        return CHI2_999[df]
    return float(chi2.ppf(0.999, df))


USERS = [f"user-{k}" for k in range(100_000)]


# -- assignment ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 2.0, 1.0)])
def test_assignment_is_balanced_by_weight_within_sampling_error(weights: tuple[float, ...]) -> None:
    spec = _spec(weights=weights)
    assigned = [spec.assign(u) for u in USERS]
    names = [v.name for v in spec.variants]
    observed = np.array([assigned.count(n) for n in names], dtype=np.float64)
    assert observed.sum() == len(USERS)  # share 1: everyone is in
    expected = len(USERS) * np.array(weights) / sum(weights)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < _chi2_quantile(len(weights) - 1), (observed, expected)


def test_the_share_of_users_inside_is_the_experiments_share() -> None:
    share = 0.3
    spec = _spec(share=share)
    assigned = [spec.assign(u) for u in USERS[:20_000]]
    inside = sum(unit("exp", "s1", u)[0] < share for u in USERS)
    n = len(USERS)
    bound = 5 * math.sqrt(n * share * (1 - share))  # five binomial standard deviations
    assert abs(inside - n * share) < bound, inside
    # The inside users are split by weight as well (the second number is independent of the first).
    some = sum(a is not None for a in assigned)
    first = sum(a == "v0" for a in assigned)
    assert abs(first - some / 2) < 5 * math.sqrt(some / 4)
    assert abs(some - 20_000 * share) < 5 * math.sqrt(20_000 * share * (1 - share))
    for u in USERS[:2000]:  # inside exactly when the first number is below the share
        assert (spec.assign(u) is not None) == (unit("exp", "s1", u)[0] < share)


def test_unit_is_two_numbers_in_the_unit_interval() -> None:
    for u in USERS[:1000]:
        a, b = unit("exp", "s1", u)
        assert 0.0 <= a < 1.0 and 0.0 <= b < 1.0
    assert unit("exp", "s1", "u") != unit("other", "s1", "u") != unit("exp", "s2", "u")


ASSIGN_SCRIPT = """
import json, sys
from model.experiments import ExperimentSpec, unit
spec = ExperimentSpec.model_validate(json.loads(sys.argv[1]))
users = [f"user-{k}" for k in range(1000)]
print(json.dumps([[*unit(spec.id, spec.salt, u), spec.assign(u)] for u in users]))
"""


@pytest.mark.parametrize("hash_seed", ["1", "987654"])
def test_assignment_is_the_same_in_another_process(hash_seed: str) -> None:
    raw = {"id": "exp", "salt": "s1", "share": 0.8, "variant": [{"name": "a"}, {"name": "b", "weight": 2}]}
    spec = ExperimentSpec.model_validate(raw)
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", ASSIGN_SCRIPT, json.dumps(raw)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    theirs = json.loads(out.stdout)
    mine = [[*unit(spec.id, spec.salt, u), spec.assign(u)] for u in USERS[:1000]]
    assert theirs == mine
    assert {a for *_, a in mine} == {"a", "b", None}


def test_another_salt_reshuffles_the_users() -> None:
    one, other = _spec(salt="first"), _spec(salt="second")
    users = USERS[:10_000]
    agree = sum(one.assign(u) == other.assign(u) for u in users) / len(users)
    assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / len(users)), agree
    assert [one.assign(u) for u in users[:1000]] == [_spec(salt="first").assign(u) for u in users[:1000]]


def test_another_non_ascii_salt_of_the_allowed_length_reshuffles_the_users() -> None:
    first, second = "é" * 32 + "a" * 32, "é" * 32 + "b" * 32  # 64 characters each: allowed
    one, other = _spec(salt=first), _spec(salt=second)
    users = USERS[:2000]
    agree = sum(one.assign(u) == other.assign(u) for u in users) / len(users)
    assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / len(users)), agree


# -- the experiments file --------------------------------------------------------------------------------
def test_the_shipped_example_reads() -> None:
    experiments = read_experiments(REPO / "docker" / "experiments.toml")
    assert experiments, "the example declares an experiment"
    first = experiments[0]
    assert first.id == "crf-vs-base" and first.method == "ab" and first.control == "exact"
    assert [v.name for v in first.variants] == ["exact", "base"]
    assert first.variants[1].inference == {"mode": "none"} and first.variants[1].changes_model
    assert not first.variants[0].changes_model


GOOD_VARIANTS = '[[experiment.variant]]\nname = "a"\n[[experiment.variant]]\nname = "b"\n'


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[[experiment]\nid = ", "not TOML"),
        ('[[experiment]]\nid = "e"\nsalt = "s"\ncolour = "red"\n' + GOOD_VARIANTS, "colour"),
        (
            '[[experiment]]\nid = "e"\nsalt = "s"\n'
            '[[experiment.variant]]\nname = "a"\n[[experiment.variant]]\nname = "a"\n',
            "variant names repeat",
        ),
        (
            '[[experiment]]\nid = "e"\nsalt = "s"\nmethod = "interleave"\n'
            + GOOD_VARIANTS
            + '[[experiment.variant]]\nname = "c"\n',
            "exactly two variants",
        ),
        (
            '[[experiment]]\nid = "e"\nsalt = "s"\nstart = 2026-02-01T00:00:00Z\n'
            "end = 2026-01-01T00:00:00Z\n" + GOOD_VARIANTS,
            "end is not after start",
        ),
        (
            '[[experiment]]\nid = "e"\nsalt = "s"\n'
            + GOOD_VARIANTS
            + '[[experiment]]\nid = "e"\nsalt = "t"\n'
            + GOOD_VARIANTS,
            "experiment ids repeat",
        ),
    ],
    ids=["not-toml", "unknown-field", "duplicate-variants", "interleave-3", "end-before-start", "repeat-ids"],
)
def test_a_bad_experiments_file_is_an_error_naming_the_problem(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "experiments.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ExperimentError) as caught:
        read_experiments(path)
    message = str(caught.value)
    assert problem in message and str(path) in message, message
    assert "Traceback" not in message and "\n" not in message
    error = caught.value  # no chained traceback: raised `from None`, or outside any handler
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_a_missing_experiments_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ExperimentError, match="cannot read"):
        read_experiments(tmp_path / "nowhere.toml")


def test_an_empty_file_has_no_experiments(tmp_path: Path) -> None:
    (tmp_path / "e.toml").write_text("# nothing yet\n", encoding="utf-8")
    assert read_experiments(tmp_path / "e.toml") == []


# -- when it runs ----------------------------------------------------------------------------------------
def test_active_runs_from_start_inclusive_to_end_exclusive_with_naive_times_utc(tmp_path: Path) -> None:
    start, end = datetime(2026, 1, 1), datetime(2026, 2, 1)  # naive: UTC
    spec = _spec(start=start, end=end)
    assert spec.start == start.replace(tzinfo=UTC) and spec.end == end.replace(tzinfo=UTC)
    t0, t1 = start.replace(tzinfo=UTC).timestamp(), end.replace(tzinfo=UTC).timestamp()
    assert not spec.active(t0 - 1) and spec.active(t0) and spec.active(t1 - 1) and not spec.active(t1)
    assert _spec().active() and _spec().active(0.0)  # no bounds: always
    assert _spec(start=start).active(t1 + 1e6) and not _spec(start=start).active(t0 - 1)
    assert _spec(end=end).active(0.0) and not _spec(end=end).active(t1)
    # An aware time keeps its offset: 01:00 at +01:00 is midnight UTC.
    plus_one = timezone(timedelta(hours=1))
    aware = _spec(start=datetime(2026, 1, 1, 1, tzinfo=plus_one))
    assert aware.active(t0) and not aware.active(t0 - 1)
    # The file's local date-times (no offset) are UTC too.
    (tmp_path / "e.toml").write_text(
        '[[experiment]]\nid = "e"\nsalt = "s"\nstart = 2026-01-01T00:00:00\n' + GOOD_VARIANTS,
        encoding="utf-8",
    )
    (read,) = read_experiments(tmp_path / "e.toml")
    assert read.start == start.replace(tzinfo=UTC) and read.active(t0) and not read.active(t0 - 1)


# -- team draft ------------------------------------------------------------------------------------------
RANKED = st.lists(st.sampled_from([f"i{k}" for k in range(12)]), unique=True, max_size=10)


@settings(max_examples=300, deadline=None)
@given(first=RANKED, second=RANKED, k=st.integers(0, 25), seed=st.text(max_size=8))
def test_team_draft_interleaves_fairly(first: list[str], second: list[str], k: int, seed: str) -> None:
    items, teams = team_draft(first, second, k, seed)
    lists = (first, second)
    assert len(items) == len(teams) == min(k, len(set(first) | set(second)))
    assert len(set(items)) == len(items)  # no duplicates
    assert set(teams) <= {0, 1}
    for item, team in zip(items, teams, strict=True):
        assert item in lists[team]  # every item comes from the list of the team credited
    for team in (0, 1):
        picked = [item for item, t in zip(items, teams, strict=True) if t == team]
        ranks = [lists[team].index(item) for item in picked]
        assert ranks == sorted(ranks)  # each team's picks in its own rank order
    picks = [0, 0]
    for t, team in enumerate(teams):
        picks[team] += 1
        taken = set(items[: t + 1])
        if all(any(i not in taken for i in ranked) for ranked in lists):  # both have items left
            assert abs(picks[0] - picks[1]) <= 1, (items, teams, t)
    assert team_draft(first, second, k, seed) == (items, teams)  # the same seed, the same draft


def test_team_draft_of_one_list_takes_it_in_order() -> None:
    assert team_draft(["a", "b", "c"], [], 5, "s") == (["a", "b", "c"], [0, 0, 0])
    assert team_draft([], ["a", "b"], 1, "s") == (["a"], [1])
    assert team_draft(["a"], ["a"], 3, "s")[0] == ["a"]
    seeds = {tuple(team_draft(["a", "b"], ["c", "d"], 4, str(s))[1]) for s in range(50)}
    assert len(seeds) > 1  # the coin decides who starts


# -- the streams' entries --------------------------------------------------------------------------------
def test_impressions_and_feedback_parse_from_their_stream_fields() -> None:
    fields = {
        b"id": b"a" * 32,
        b"at": b"12.5",
        b"user": b"u",
        b"items": b'["x","y"]',
        b"scores": b"[4.0,3.5]",
        b"dists": b"[[0.1,0.2,0.3,0.2,0.2],null]",
        b"experiment": b"e",
        b"variant": b"v0",
        b"teams": b'["v0","v1"]',
    }
    imp = parse_impression(fields)
    assert imp == Impression(
        "a" * 32,
        12.5,
        "u",
        ("x", "y"),
        (4.0, 3.5),
        ((0.1, 0.2, 0.3, 0.2, 0.2), None),
        "e",
        "v0",
        ("v0", "v1"),
    )
    assert parse_impression({b"id": b"x", b"at": b"1"}) is None
    assert parse_impression({**fields, b"items": b"not json"}) is None
    assert parse_feedback("2000-1", {b"user": b"u", b"item": b"x", b"rating": b"4.0"}) == Feedback(
        2.0, "u", "x", 4.0, "rating"
    )
    rec = "b" * 32
    assert parse_feedback("3500-0", {"user": "u", "item": "x", "event": "click", "rec": rec}) == Feedback(
        3.5, "u", "x", None, "click", rec
    )
    assert parse_feedback("1-0", {"user": "u", "forget": "1"}) is None
    assert parse_feedback("1-0", {"user": "u", "item": "x", "retract": "1"}) is None
    assert parse_feedback("1-0", {"user": "u", "item": "x", "rating": "nan"}) is None


# -- results ---------------------------------------------------------------------------------------------
def _imp(
    id: str,
    at: float,
    user: str,
    items: tuple[str, ...],
    variant: str | None,
    scores: tuple[float, ...] | None = None,
    dists: tuple[tuple[float, ...] | None, ...] | None = None,
    experiment: str = "exp",
    teams: tuple[str, ...] | None = None,
) -> Impression:
    scores = scores if scores is not None else tuple(3.0 for _ in items)
    return Impression(id, at, user, items, scores, dists, experiment, variant, teams)


def _click(at: float, user: str, item: str, rec: str | None = None) -> Feedback:
    return Feedback(at, user, item, None, "click", rec)


def _rate(at: float, user: str, item: str, rating: float, rec: str | None = None) -> Feedback:
    return Feedback(at, user, item, rating, "rating", rec)


def test_results_of_hand_built_impressions_and_feedback() -> None:
    spec = _spec(names=["a", "b"], window_s=100.0, hit_rating=4.0)
    impressions = [
        _imp(
            "a1",
            1000.0,
            "u1",
            ("i1", "i2", "i3"),
            "a",
            scores=(4.0, 3.0, 2.0),
            dists=((0.0, 0.0, 0.0, 0.5, 0.5), None, (0.2, 0.2, 0.2, 0.2, 0.2)),
        ),
        _imp("a2", 1000.0, "u2", ("i1", "i4"), "a", scores=(5.0, 1.0)),
        _imp("b1", 1000.0, "u3", ("i5", "i6"), "b"),
        _imp("other", 1000.0, "u1", ("i1",), "a", experiment="another"),  # not this experiment's
    ]
    feedback = [
        _rate(1010.0, "u1", "i1", 5.0),  # a1: a hit, (4 - 5)^2, -log 0.5
        _rate(1020.0, "u1", "i1", 2.0),  # the same pair again: its first rating counts
        _rate(1030.0, "u1", "i3", 3.0, rec="a1"),  # named: (2 - 3)^2, -log 0.2
        _click(1005.0, "u2", "i4"),  # a2: a click, so a hit
        _rate(1006.0, "u2", "i4", 1.0),  # a2: below the hit rating; (1 - 1)^2, no distribution
        _rate(1500.0, "u3", "i5", 2.0),  # after the window
        _rate(1010.0, "u3", "i9", 5.0),  # not shown
        _click(1010.0, "u4", "i5"),  # a user never shown anything
    ]
    out = results(spec, impressions, feedback, LEVELS, n_items=20)
    assert out["experiment"] == "exp" and out["method"] == "ab" and out["control"] == "a"
    assert out["hit_rating"] == 4.0 and out["impressions_read"] == 4 and out["feedback_read"] == 8
    a, b = out["variants"]["a"], out["variants"]["b"]
    assert a["impressions"] == 2 and a["users"] == 2
    assert a["click_through"]["value"] == pytest.approx(0.5)
    assert a["hit_rate"]["value"] == pytest.approx(1.0)
    assert a["mean_later_rating"]["value"] == pytest.approx((5.0 + 3.0 + 1.0) / 3)
    assert a["mean_later_rating"]["n"] == 3
    assert a["rmse"]["value"] == pytest.approx(math.sqrt((1.0 + 1.0 + 0.0) / 3))
    assert a["log_loss"]["value"] == pytest.approx((-math.log(0.5) - math.log(0.2)) / 2)
    # Coverage at as many users as the smallest variant holds (b: one): the expected distinct items of
    # one of a's users, (3 + 2) / 2, of the 20.
    assert out["coverage_users"] == 1
    assert a["coverage"]["value"] == pytest.approx(2.5 / 20) and a["coverage"]["n"] == 1
    assert a["click_through"]["low"] is not None  # two users: an interval
    # A variant with one user has no interval; one without ratings has no rating figures.
    assert b["impressions"] == 1 and b["users"] == 1
    assert b["click_through"]["value"] == 0.0 and b["hit_rate"]["value"] == 0.0
    for metric in ("click_through", "hit_rate", "coverage"):
        assert b[metric]["low"] is None and b[metric]["high"] is None and b[metric]["se"] is None
    assert b["coverage"]["value"] == pytest.approx(2 / 20)
    for metric in ("mean_later_rating", "rmse", "log_loss"):
        assert b[metric]["value"] is None
    assert out["differences"]["b"]["hit_rate"] == {
        "value": None,
        "low": None,
        "high": None,
        "significant": False,
    }


def test_the_default_hit_rating_is_three_quarters_up_the_scale() -> None:
    spec = _spec(names=["a", "b"])
    assert spec.hit_threshold(LEVELS) == 4.0 and spec.hit_threshold([0.5, 1.0, 2.5]) == 2.0
    imps = [_imp("p", 0.0, "u", ("x", "y"), "a")]
    out = results(spec, imps, [_rate(1.0, "u", "x", 4.0)], LEVELS, 10)
    assert out["hit_rating"] == 4.0 and out["variants"]["a"]["hit_rate"]["value"] == 1.0
    out = results(spec, imps, [_rate(1.0, "u", "x", 3.0)], LEVELS, 10)
    assert out["variants"]["a"]["hit_rate"]["value"] == 0.0


THREE = {"names": ["a", "b", "c"], "weights": (1.0, 1.0, 1.0), "window_s": 100.0}


def _clicked(out: dict[str, Any]) -> dict[str, float | None]:
    """Each variant's click-through (which impression a click went to: one impression per variant)."""
    return {name: v["click_through"]["value"] for name, v in out["variants"].items()}


def test_named_feedback_goes_to_the_impression_it_names_only() -> None:
    spec = _spec(**THREE)
    imps = [
        _imp("p1", 1000.0, "u", ("x", "y"), "a"),
        _imp("p2", 1050.0, "u", ("x",), "b"),  # later, showing x too
        _imp("p3", 1060.0, "w", ("x",), "c"),  # another user's
    ]
    out = results(spec, imps, [_click(1070.0, "u", "x", rec="p1")], LEVELS, 10)
    assert _clicked(out) == {"a": 1.0, "b": 0.0, "c": 0.0}
    unnamed = results(spec, imps, [_click(1070.0, "u", "x")], LEVELS, 10)
    assert _clicked(unnamed) == {"a": 0.0, "b": 1.0, "c": 0.0}  # the latest of the user's
    other_user = results(spec, imps, [_click(1070.0, "u", "x", rec="p3")], LEVELS, 10)
    assert _clicked(other_user) == {"a": 0.0, "b": 0.0, "c": 0.0}  # it names another user's answer


def test_named_feedback_for_an_impression_that_did_not_show_the_item_goes_nowhere() -> None:
    spec = _spec(**THREE)
    imps = [_imp("p1", 1000.0, "u", ("x",), "a"), _imp("p2", 1010.0, "u", ("y",), "b")]
    out = results(spec, imps, [_click(1020.0, "u", "x", rec="p2")], LEVELS, 10)
    assert _clicked(out) == {"a": 0.0, "b": 0.0, "c": None}


def test_feedback_naming_an_impression_outside_the_experiment_is_not_credited_to_it() -> None:
    spec = _spec(**THREE)
    imps = [
        _imp("p1", 1000.0, "u", ("x",), "a"),
        _imp("similar", 1010.0, "u", ("x",), None, experiment=None),  # an answer of no experiment
    ]
    out = results(spec, imps, [_click(1020.0, "u", "x", rec="similar")], LEVELS, 10)
    assert _clicked(out)["a"] == 0.0  # the click followed the other answer, not p1


def test_unnamed_feedback_goes_to_the_latest_impression_showing_the_item_within_the_window() -> None:
    spec = _spec(**THREE)
    imps = [
        _imp("p1", 1000.0, "u", ("x", "y"), "a"),
        _imp("p2", 1050.0, "u", ("x", "z"), "b"),
        _imp("p3", 1070.0, "u", ("y", "z"), "c"),  # the latest, but without x
    ]
    assert _clicked(results(spec, imps, [_click(1080.0, "u", "x")], LEVELS, 10)) == {
        "a": 0.0,
        "b": 1.0,
        "c": 0.0,
    }
    # Not to an impression after the feedback: p2 and p3 come later than a click at 1020.
    assert _clicked(results(spec, imps, [_click(1020.0, "u", "x")], LEVELS, 10)) == {
        "a": 1.0,
        "b": 0.0,
        "c": 0.0,
    }
    assert _clicked(results(spec, imps, [_click(1020.0, "u", "z")], LEVELS, 10)) == {
        "a": 0.0,
        "b": 0.0,
        "c": 0.0,
    }
    # Not to one outside the window (100 s): at 1160 only p2 (110 s before) and p3 show z ...
    assert _clicked(results(spec, imps, [_click(1160.0, "u", "x")], LEVELS, 10)) == {
        "a": 0.0,
        "b": 0.0,
        "c": 0.0,
    }
    assert _clicked(results(spec, imps, [_click(1160.0, "u", "z")], LEVELS, 10)) == {
        "a": 0.0,
        "b": 0.0,
        "c": 1.0,
    }
    # ... and a window's end is inclusive: p2 is exactly 100 s before.
    assert _clicked(results(spec, imps, [_click(1150.0, "u", "x")], LEVELS, 10))["b"] == 1.0


def test_a_pairs_first_rating_counts_once_per_impression() -> None:
    spec = _spec(names=["a", "b"], window_s=1000.0, hit_rating=4.0)
    imps = [_imp("p1", 0.0, "u", ("x",), "a", scores=(4.0,)), _imp("p2", 100.0, "u", ("x",), "b")]
    feedback = [
        _rate(10.0, "u", "x", 2.0),  # p1's
        _rate(20.0, "u", "x", 5.0),  # p1 again: not counted (nor a hit)
        _rate(110.0, "u", "x", 5.0),  # p2's first
        _rate(120.0, "u", "x", 1.0),  # not counted
    ]
    out = results(spec, imps, feedback, LEVELS, 10)
    a, b = out["variants"]["a"], out["variants"]["b"]
    assert a["mean_later_rating"]["value"] == 2.0 and a["mean_later_rating"]["n"] == 1
    assert a["rmse"]["value"] == pytest.approx(2.0) and a["hit_rate"]["value"] == 0.0
    assert b["mean_later_rating"]["value"] == 5.0 and b["hit_rate"]["value"] == 1.0


def _proportion(name: str, users: int, hits: int, start: int = 0) -> list[Impression | Feedback]:
    """`users` users of variant `name`, one impression each, the first `hits` of whom click."""
    out: list[Impression | Feedback] = []
    for k in range(users):
        user = f"{name}-{start + k}"
        out.append(_imp(f"{user}-p", 0.0, user, ("x", "y"), name))
        if k < hits:
            out.append(_click(1.0, user, "x"))
    return out


def _split(rows: list[Impression | Feedback]) -> tuple[list[Impression], list[Feedback]]:
    return [r for r in rows if isinstance(r, Impression)], [r for r in rows if isinstance(r, Feedback)]


def test_with_one_impression_per_user_the_interval_is_close_to_the_binomial_one() -> None:
    spec = _spec(names=["a", "b"])
    n, p = 400, 0.3
    imps, feedback = _split(_proportion("a", n, int(n * p)) + _proportion("b", n, 200))
    out = results(spec, imps, feedback, LEVELS, 10)
    figure = out["variants"]["a"]["click_through"]
    binomial = math.sqrt(p * (1 - p) / n)
    assert figure["value"] == pytest.approx(p) and figure["n"] == n
    assert figure["se"] == pytest.approx(binomial, rel=0.01)
    assert figure["low"] == pytest.approx(p - 1.96 * binomial, rel=0.01)
    assert figure["high"] == pytest.approx(p + 1.96 * binomial, rel=0.01)
    # b - a, the two errors combined: 0.5 - 0.3 is far outside the noise.
    diff = out["differences"]["b"]["click_through"]
    se = math.sqrt(binomial**2 + 0.25 / n)
    assert diff["value"] == pytest.approx(0.2) and diff["significant"]
    assert diff["low"] == pytest.approx(0.2 - 1.96 * se, rel=0.02)
    assert diff["high"] == pytest.approx(0.2 + 1.96 * se, rel=0.02)
    lower = results(spec, *_split(_proportion("a", n, 200) + _proportion("b", n, 120)), LEVELS, 10)
    assert lower["differences"]["b"]["click_through"]["value"] == pytest.approx(-0.2)  # b - control
    assert lower["differences"]["b"]["click_through"]["significant"]
    close = results(spec, *_split(_proportion("a", n, 120) + _proportion("b", n, 124)), LEVELS, 10)
    near = close["differences"]["b"]["click_through"]
    assert near["value"] == pytest.approx(0.01) and not near["significant"]
    assert near["low"] < 0 < near["high"]


def test_a_users_impressions_are_one_unit_of_the_interval() -> None:
    """Ten impressions of one user, all clicked or none: as uncertain as one impression per user, not as
    ten independent ones."""
    spec = _spec(names=["a", "b"])
    imps, feedback = [], []
    for k in range(100):
        for t in range(10):
            imps.append(_imp(f"p{k}-{t}", 10.0 * t, f"u{k}", ("x",), "a"))
            if k < 30:
                feedback.append(_click(10.0 * t + 2.0, f"u{k}", "x"))
    figure = results(spec, imps, feedback, LEVELS, 10)["variants"]["a"]["click_through"]
    assert figure["value"] == pytest.approx(0.3) and figure["n"] == 1000
    assert figure["se"] == pytest.approx(math.sqrt(0.3 * 0.7 / 100), rel=0.01)


def _aa_rows(seed: int) -> tuple[ExperimentSpec, list[Impression], list[Feedback]]:
    """Random users of two identical variants: each user has a propensity to hit, one to three
    impressions of four items, clicks and ratings drawn from the same distributions in both."""
    rng = np.random.default_rng(seed)
    spec = _spec(names=["a", "b"], hit_rating=4.0)
    n = 120
    variant = rng.integers(0, 2, n)
    shown = rng.integers(1, 4, n)  # impressions per user
    owner = np.repeat(np.arange(n), shown)
    turn = np.concatenate([np.arange(c) for c in shown])
    total = len(owner)
    items = np.argsort(rng.random((total, 40)), axis=1)[:, :4].tolist()
    scores = rng.uniform(1, 5, (total, 4)).tolist()
    clicked = (rng.random(total) < rng.beta(2.0, 5.0, n)[owner]).tolist()
    rated = (rng.random(total) < 0.5).tolist()
    click_at, rate_at = rng.integers(0, 4, total).tolist(), rng.integers(0, 4, total).tolist()
    ratings = rng.integers(1, 6, total).astype(float).tolist()
    imps: list[Impression] = []
    feedback: list[Feedback] = []
    for t, (k, when) in enumerate(zip(owner.tolist(), turn.tolist(), strict=True)):
        user, at = f"u{k}", 100.0 * when
        names = tuple(f"i{j}" for j in items[t])
        imps.append(_imp(f"{user}-{when}", at, user, names, "ab"[variant[k]], scores=tuple(scores[t])))
        if clicked[t]:
            feedback.append(_click(at + 2.0, user, names[click_at[t]]))
        if rated[t]:
            feedback.append(_rate(at + 3.0, user, names[rate_at[t]], ratings[t]))
    return spec, imps, feedback


def test_an_aa_simulation_is_significant_about_as_often_as_the_level_says() -> None:
    significant = 0
    for seed in range(200):
        spec, imps, feedback = _aa_rows(seed)
        out = results(spec, imps, feedback, LEVELS, 40)
        significant += out["differences"]["b"]["hit_rate"]["significant"]
    assert 0.01 <= significant / 200 <= 0.11, significant


def _interleaved(winner: str, users: int = 30) -> tuple[ExperimentSpec, list[Impression], list[Feedback]]:
    spec = _spec(names=["x", "y"], method="interleave", hit_rating=4.0)
    imps: list[Impression] = []
    feedback: list[Feedback] = []
    for k in range(users):
        user = f"u{k}"
        first, second = [f"a{j}" for j in range(5)], [f"b{j}" for j in range(5)]
        items, teams = team_draft(first, second, 6, f"{user}-0")
        names = tuple(spec.variants[t].name for t in teams)
        imps.append(_imp(f"{user}-p", 0.0, user, tuple(items), None, teams=names))
        won = [item for item, name in zip(items, names, strict=True) if name == winner]
        feedback.append(_click(1.0, user, won[0]))
        if k % 3 == 0:  # some also rate one of the loser's items low: no hit
            lost = [item for item, name in zip(items, names, strict=True) if name != winner]
            feedback.append(_rate(2.0, user, lost[0], 2.0))
    return spec, imps, feedback


@pytest.mark.parametrize("winner", ["x", "y"])
def test_interleavings_preference_follows_the_team_that_gets_the_clicks(winner: str) -> None:
    spec, imps, feedback = _interleaved(winner)
    out = results(spec, imps, feedback, LEVELS, 10)
    inter = out["interleaving"]
    loser = "y" if winner == "x" else "x"
    assert inter["users"] == 30 and inter["wins"] == {winner: 30, loser: 0} and inter["ties"] == 0
    sign = 1.0 if winner == "y" else -1.0  # the second variant's share minus the first's
    assert inter["preference"]["value"] == pytest.approx(sign)
    assert out["variants"][winner]["click_through"]["value"] == 1.0
    assert out["variants"][loser]["click_through"]["value"] == 0.0
    assert out["variants"][winner]["impressions"] == out["variants"][loser]["impressions"] == 30


def test_a_mixed_interleaving_preference_has_an_interval() -> None:
    spec, imps, feedback = _interleaved("y", users=40)
    # A quarter of the users click the first team's item instead: preference (30 - 10) / 40.
    turned = {f"u{k}" for k in range(10)}
    swapped = []
    for fb in feedback:
        if fb.user in turned and fb.kind == "click":
            imp = next(i for i in imps if i.user == fb.user)
            x_item = next(i for i, t in zip(imp.items, imp.teams or (), strict=True) if t == "x")
            fb = _click(fb.at, fb.user, x_item)
        swapped.append(fb)
    pref = results(spec, imps, swapped, LEVELS, 10)["interleaving"]["preference"]
    assert pref["value"] == pytest.approx(0.5) and pref["low"] < 0.5 < pref["high"] and pref["significant"]


def test_the_report_table_mentions_every_variant() -> None:
    spec = _spec(names=["control", "treatment", "third"], weights=(1.0, 1.0, 1.0))
    rows = _proportion("control", 20, 5) + _proportion("treatment", 20, 15) + _proportion("third", 1, 1)
    table = report_table(results(spec, *_split(rows), LEVELS, 10))
    assert "experiment exp (ab; control control)" in table
    for name in ("control", "treatment", "third", "treatment - control", "third - control"):
        assert name in table
    assert " *" in table  # treatment's click-through is significantly higher
    inter_spec, imps, feedback = _interleaved("y")
    inter = report_table(results(inter_spec, imps, feedback, LEVELS, 10))
    assert "x" in inter and "y - x" in inter and "interleaving: 30 users" in inter
    empty = report_table(results(spec, [], [], LEVELS, 10))  # nothing shown yet
    assert all(name in empty for name in ("control", "treatment", "third"))
