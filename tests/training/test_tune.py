"""The automatic selection of the inference settings (training/tune.py): its search space, its record,
and that it reads the artifact's validation ratings and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model.artifact import load_artifact
from model.config import ConfigError, InferenceConfig, search_space, setting_names
from model.scorers import artifact_scorer
from training import cli
from training.pipeline import run_training
from training.synthetic import low_rank_ratings, write_csv
from training.tune import DEFAULT_TRIALS, START, settings_of, tune, tune_artifact, units

FAST = {"epochs": "4", "val_fraction": "0.1"}
"""The default preset cut to a few epochs, with enough validation ratings for a search."""


def _data(directory: Path, scramble: bool) -> Path:
    """train.csv and test.csv of a seeded 80 x 60 matrix; `scramble` shuffles the test ratings' values."""
    triples = low_rank_ratings(n_users=80, n_items=60, density=0.6, seed=3)
    rng = np.random.default_rng(0)
    test = rng.random(len(triples)) < 0.2
    train = [t for t, is_test in zip(triples, test, strict=True) if not is_test]
    held = [t for t, is_test in zip(triples, test, strict=True) if is_test]
    if scramble:
        values = [r for _, _, r in held]
        rng.shuffle(values)
        held = [(u, i, v) for (u, i, _), v in zip(held, values, strict=True)]
        original = [t for t, is_test in zip(triples, test, strict=True) if is_test]
        assert any(a[2] != b[2] for a, b in zip(held, original, strict=True))
    write_csv(directory / "train.csv", train)
    write_csv(directory / "test.csv", held)
    return directory


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    """An artifact of the default preset (cut short), tuned by `run_training` with 6 trials."""
    root = tmp_path_factory.mktemp("tune")
    data = _data(root / "data", scramble=False)
    out = root / "artifact"
    metrics = run_training(
        "csv", data, out, preset_name="default", settings=FAST, progress=False, tune_trials=6
    )
    return out, metrics


def test_the_search_space_is_declared_with_the_settings() -> None:
    space = search_space()
    assert set(space) <= set(setting_names()) and set(START) == set(space)
    for name, r in space.items():
        assert 0 < r.low < r.high, name
        assert r.low <= START[name] <= r.high or (START[name] == 0 and r.off), name
    # One range for every dataset: in units of the rating scale and of the matrix size.
    scale = units(np.arange(1.0, 101.0, 1.5), n_users=30, n_items=40)
    assert scale["gap^-2"] == pytest.approx(1 / 1.5**2) and scale["range^2"] == pytest.approx(99**2)
    settings = settings_of({**START, "crf.tau": 1.0, "kernel.co_rating": 2.0}, scale)
    assert settings["crf.tau"] == pytest.approx(99**2) and settings["kernel.co_rating"] == 60.0
    assert settings["mode"] == "exact" and settings["kernel.known"] == "clamped"
    InferenceConfig().with_overrides(settings)  # a valid inference config
    assert cli.DEFAULT_TRIALS == DEFAULT_TRIALS


def test_train_searches_the_inference_and_records_every_trial(tuned: tuple[Path, dict[str, object]]) -> None:
    out, metrics = tuned
    summary = metrics["tuning"]
    assert isinstance(summary, dict) and summary["trials"] == 6
    artifact = load_artifact(out)
    record = json.loads((out / "tuning.json").read_text())
    assert len(record["trials"]) == 6 and record["trials"][0]["relative"] == START
    assert record["n_validation"] == len(artifact.held_out) >= 100
    assert record["n_known"] == len(artifact.train)
    best = min(record["trials"], key=lambda t: t["val_rmse"])
    assert record["best_val_rmse"] == best["val_rmse"]
    assert artifact.inference.to_dict() == record["chosen"]
    if record["chosen"]["mode"] == "exact":
        assert best["val_rmse"] < record["base_network_val_rmse"]
        assert {k: v for k, v in best["settings"].items() if k != "mode"} == {
            name: artifact.inference.to_dict()[name.split(".")[0]][name.split(".")[1]]
            for name in search_space()
        }
        # The stored field is the chosen settings': the service reads it instead of recomputing.
        _, scorer = artifact_scorer(artifact)
        assert getattr(scorer, "field_source", None) == "artifact"
    else:
        assert best["val_rmse"] >= record["base_network_val_rmse"]
    # Each trial's RMSE is what that setting scores on the validation ratings with the training ratings
    # known: rescored here through the ordinary scorer (no shared parts), for the best trial.
    from model.engine import expected_rating
    from model.scorers import build_scorer, load_network

    network = load_network(artifact)
    val = artifact.held_out
    inference = InferenceConfig().with_overrides(settings_of(best["relative"], record["units"]))
    dist = build_scorer(network, artifact.train, inference).predict(
        val.rows, val.cols, network.probabilities(val.rows, val.cols)
    )
    pred = np.clip(expected_rating(dist, artifact.levels), artifact.levels[0], artifact.levels[-1])
    assert np.sqrt(np.mean((pred - val.values) ** 2)) == pytest.approx(best["val_rmse"], abs=1e-12)


def test_the_search_never_reads_the_test_ratings(
    tuned: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    # The same training data with the test ratings' values shuffled: the same choice, trial by trial.
    out, _ = tuned
    data = _data(tmp_path / "data", scramble=True)
    other = tmp_path / "artifact"
    run_training("csv", data, other, preset_name="default", settings=FAST, progress=False, tune_trials=6)
    mine = json.loads((out / "tuning.json").read_text())
    theirs = json.loads((other / "tuning.json").read_text())
    assert theirs["chosen"] == mine["chosen"]
    assert [t["val_rmse"] for t in theirs["trials"]] == [t["val_rmse"] for t in mine["trials"]]
    assert [t["settings"] for t in theirs["trials"]] == [t["settings"] for t in mine["trials"]]


def test_dcmc_tune_rewrites_an_artifact(
    tuned: tuple[Path, dict[str, object]], tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tuned[0], copy)
    before = load_artifact(copy).model_version
    assert cli.main(["tune", "--artifacts", str(copy), "--trials", "3", "--seed", "1", "--no-progress"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["trials_run"] == 3
    after = load_artifact(copy)
    assert after.model_version != before and after.inference.to_dict() == printed["chosen"]
    assert json.loads((copy / "tuning.json").read_text())["seed"] == 1
    assert cli.main(["tune", "--artifacts", str(copy), "--trials", "0"]) == 2
    assert "trials must be at least 1" in capsys.readouterr().err


def test_a_search_needs_validation_ratings(exact_artifact: Path) -> None:
    artifact = load_artifact(exact_artifact)  # the tiny preset's random split: 5% validation, under 100
    assert len(artifact.held_out) < 100
    with pytest.raises(ConfigError, match="validation ratings; a search needs at least 100"):
        tune(artifact, trials=2, progress=False)


def test_explicit_settings_and_no_tune_are_kept(tmp_path: Path) -> None:
    data = _data(tmp_path / "data", scramble=False)
    metrics = run_training(
        "csv", data, tmp_path / "a", preset_name="default", settings=FAST, progress=False, tune=False
    )
    assert "--no-tune" in metrics["tuning"]["skipped"]
    assert not (tmp_path / "a" / "tuning.json").exists()
    assert load_artifact(tmp_path / "a").inference.kernel.co_rating == pytest.approx(
        START["kernel.co_rating"] * load_artifact(tmp_path / "a").config.n_users
    )
    settings = {**FAST, "inference.crf.gamma": "2.5"}
    metrics = run_training(
        "csv", data, tmp_path / "b", preset_name="default", settings=settings, progress=False
    )
    assert "inference.crf.gamma" in metrics["tuning"]["skipped"]
    assert load_artifact(tmp_path / "b").inference.crf.gamma == 2.5


def test_tune_artifact_refuses_a_tampered_artifact(
    tuned: tuple[Path, dict[str, object]], tmp_path: Path
) -> None:
    import shutil

    from model.artifact import ArtifactError

    copy = tmp_path / "copy"
    shutil.copytree(tuned[0], copy)
    (copy / "train_ratings.npz").write_bytes(b"not the ratings")
    with pytest.raises(ArtifactError, match="fails its checksum"):
        tune_artifact(copy, trials=2, progress=False)


def test_the_search_weighs_co_rating_terms_through_sparse_tables_on_a_large_matrix(
    tuned: tuple[Path, dict[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Epinions has 139,738 items: sparse neighbour tables (model.exact.DENSE_TABLE_MAX). Here: 60 items
    # and 80 users > 50, so both tables are sparse, and the search still tries the co-rating terms.
    from model import exact

    monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 50)
    monkeypatch.setattr(exact.affinity, "CO_RATING_NEIGHBOURS", 5)
    artifact = load_artifact(tuned[0])
    assert artifact.config.n_items == 60 and artifact.config.n_users == 80
    result = tune(artifact, trials=8, progress=False)
    co_rated = [t for t in result.record["trials"] if t["settings"]["kernel.co_rating"] > 0]
    assert co_rated and all(np.isfinite(t["val_rmse"]) for t in result.record["trials"])


def test_a_co_rating_table_over_the_pair_budget_is_left_out_of_the_search(
    tuned: tuple[Path, dict[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # ml-10m's user table would cost 122 G co-rated pairs: the search must not try to build it. Here the
    # budget sits between the two sparse tables' costs, so the user term is left off and the item term kept.
    from model import exact

    monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 50)
    monkeypatch.setattr(exact.affinity, "CO_RATING_NEIGHBOURS", 5)
    artifact = load_artifact(tuned[0])
    items, users = exact.gram_cost(artifact.train, "items"), exact.gram_cost(artifact.train, "users")
    assert items < users  # 80 users x 60 items: an item is rated by more users than a user rates items
    monkeypatch.setattr(exact.gram, "GRAM_PAIR_BUDGET", (items + users) // 2)
    built: list[str] = []
    gram_of = exact.CoRatingGram.of.__func__  # type: ignore[attr-defined]

    def recording(cls, rows, cols, values, n, m, what="items"):  # type: ignore[no-untyped-def]
        built.append(what)
        return gram_of(cls, rows, cols, values, n, m, what)

    monkeypatch.setattr(exact.CoRatingGram, "of", classmethod(recording))
    result = tune(artifact, trials=8, progress=False)
    trials = result.record["trials"]
    assert all(t["settings"]["kernel.co_rating_user"] == 0 for t in trials)
    assert any(t["settings"]["kernel.co_rating"] > 0 for t in trials)
    assert result.record["left_off"]["terms"] == {"kernel.co_rating_user": users}
    assert built == ["items"]  # the user table was never built
    assert result.chosen.kernel.co_rating_user == 0


def test_the_untuned_start_leaves_a_costly_term_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from model import exact
    from model.ratings import Ratings
    from training.tune import start_inference

    rng = np.random.default_rng(0)
    known = Ratings(rng.integers(0, 40, 500), rng.integers(0, 70, 500), rng.integers(1, 6, 500), 40, 70)
    levels = np.arange(1.0, 6.0)
    assert start_inference(levels, 40, 70, known).kernel.co_rating > 0
    monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", 50)  # the item table (70 lines) is now sparse
    monkeypatch.setattr(exact.gram, "GRAM_PAIR_BUDGET", exact.gram_cost(known, "items") - 1)
    inference = start_inference(levels, 40, 70, known)
    assert inference.kernel.co_rating == 0 and inference.kernel.co_rating_user > 0
    assert start_inference(levels, 40, 70).kernel.co_rating > 0  # without the ratings: START as it is


def test_refit_publishes_a_network_of_every_training_rating_with_the_carves_choices(
    tmp_path: Path, tuned: tuple[Path, dict[str, object]]
) -> None:
    """`refit`: the search and the fold-in choice run on the carve exactly as without it (same seed, same
    network, same record), then the published network trains again on every training rating."""
    carve_out, carve_metrics = tuned
    data = _data(tmp_path / "data", scramble=False)
    out = tmp_path / "refit"
    metrics = run_training(
        "csv",
        data,
        out,
        preset_name="default",
        settings={**FAST, "refit": "true"},
        progress=False,
        tune_trials=6,
    )
    carve, refit = load_artifact(carve_out), load_artifact(out)
    assert not (tmp_path / ".refit.carve").exists()  # the carve's artifact is not left behind
    # Every training rating is known and trained on; none is held out.
    assert len(refit.held_out) == 0
    assert len(refit.train) == len(carve.train) + len(carve.held_out)
    assert refit.meta["train"]["refit"] is True and refit.meta["train"]["epochs"] == 4
    # The carve's choices, unchanged: settings, the search's record, the fold-in policy.
    assert refit.inference.to_dict() == carve.inference.to_dict()

    def untimed(record: object) -> object:  # the same search, bar the seconds it took
        assert isinstance(record, dict)
        return {k: v for k, v in record.items() if "_s" not in k and "seconds" not in k and k != "trials"}

    record, carve_record = (json.loads((d / "tuning.json").read_text()) for d in (out, carve_out))
    assert untimed(record) == untimed(carve_record) and record["n_known"] == len(carve.train)
    assert [t["val_rmse"] for t in record["trials"]] == [t["val_rmse"] for t in carve_record["trials"]]
    assert untimed(metrics["tuning"]) == untimed(carve_metrics["tuning"])
    assert metrics["val_rmse"] == carve_metrics["val_rmse"]
    assert untimed(refit.meta.get("fold_in")) == untimed(carve.meta.get("fold_in"))
    refit_record = metrics["refit"]
    assert isinstance(refit_record, dict) and refit_record["n_train"] == len(refit.train)
    assert len(refit_record["history"]) == 4
    # Another network: trained on more ratings, its embeddings differ from the carve's.
    assert not np.allclose(np.load(out / "user_embeddings.npy"), np.load(carve_out / "user_embeddings.npy"))
    if refit.inference.mode == "exact":  # the stored field is the new network's over every known rating
        _, scorer = artifact_scorer(refit)
        assert getattr(scorer, "field_source", None) == "artifact"
    # There is nothing left to validate on: `dcmc evaluate --part val` says so.
    from training.data import DataError
    from training.evaluate import evaluate

    with pytest.raises(DataError, match="no validation ratings are left"):
        evaluate(out, data, part="val")
    assert evaluate(out, data)["n"] > 0


def test_folds_choose_on_every_training_rating_then_refit(tmp_path: Path) -> None:
    """`folds`: one network per fold, each without its fold; the search scores a candidate over all
    training ratings (each predicted by the network that did not train on it); then the refit."""
    data = _data(tmp_path / "data", scramble=False)
    out = tmp_path / "folds"
    metrics = run_training(
        "csv",
        data,
        out,
        preset_name="default",
        settings={"epochs": "3", "refit": "true", "folds": "3"},
        progress=False,
        tune_trials=4,
    )
    artifact = load_artifact(out)
    n = len(artifact.train)
    assert len(artifact.held_out) == 0 and artifact.meta["train"]["folds"] == 3
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no fold's artifact left
    record = json.loads((out / "tuning.json").read_text())
    assert record["folds"] == 3 and record["n_validation"] == n == metrics["n_val"]
    assert len(record["n_known"]) == 3 and sum(record["n_known"]) == 2 * n  # each rating known in 2 folds
    folds = metrics["folds"]
    assert (
        isinstance(folds, dict)
        and sum(folds["n_val"]) == n
        and max(folds["n_val"]) - min(folds["n_val"]) <= 1
    )
    assert metrics["tuning"]["folds"] == 3 and metrics["refit"]["n_train"] == n
    assert artifact.inference.to_dict() == InferenceConfig.from_dict(record["chosen"]).to_dict()


def test_a_search_over_folds_pools_their_validation_ratings(tmp_path: Path) -> None:
    from model.engine import expected_rating
    from model.scorers import load_network

    data = _data(tmp_path / "data", scramble=False)
    outs = []
    for seed in (1, 2):  # two carves of one matrix
        outs.append(tmp_path / f"a{seed}")
        settings = {"epochs": "2", "val_fraction": "0.2"}
        run_training("csv", data, outs[-1], preset_name="tiny", settings=settings, seed=seed, progress=False)
    artifacts = [load_artifact(o) for o in outs]
    squared = []
    for a in artifacts:
        network, val = load_network(a), a.held_out
        pred = expected_rating(network.probabilities(val.rows, val.cols), a.levels)
        squared.append((np.clip(pred, a.levels[0], a.levels[-1]) - val.values) ** 2)
    result = tune(artifacts, trials=2, progress=False)
    pooled = float(np.sqrt(np.mean(np.concatenate(squared))))
    assert result.record["base_network_val_rmse"] == pytest.approx(pooled)
    assert result.record["n_validation"] == sum(len(a.held_out) for a in artifacts)
    alone = tune(artifacts[0], trials=2, progress=False).record["base_network_val_rmse"]
    assert alone == pytest.approx(float(np.sqrt(np.mean(squared[0]))))


def test_folds_choose_nothing_without_refit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from training.config import TrainConfig

    with pytest.raises(ConfigError, match="folds must be at least 1"):
        TrainConfig(folds=0)
    data = _data(tmp_path / "data", scramble=False)
    out = tmp_path / "art"
    with caplog.at_level("WARNING"):
        metrics = run_training("csv", data, out, preset_name="default", progress=False, tune_trials=2,
                               settings={"epochs": "1", "folds": "3", "val_fraction": "0.1"})  # fmt: skip
    assert "folds=3 unused: refit is off" in caplog.text
    assert "folds" not in metrics and load_artifact(out).held_out is not None
    assert len(load_artifact(out).held_out) == metrics["n_val"] > 0  # one carve, as without folds
