"""Fold-in snapshots (model/online.py): a restored snapshot is the state it was taken of and goes on alike;
one that does not fit the artifact or the settings is refused and changes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model.artifact import Artifact, load_artifact
from model.online import FoldIn
from tests.model.test_online import EXACT, _batch, _fold


@pytest.fixture(scope="module")
def artifact(tiny_artifact: Path) -> Artifact:
    return load_artifact(tiny_artifact)


def _answers(fold: FoldIn) -> np.ndarray:
    """Every (user, item) answer of the published state: the scorer's distributions' expected ratings
    where the item has an embedding, the bias baseline where it has none."""
    state = fold.state
    n, m = state.network.n_users, state.network.n_items
    rows, cols = np.repeat(np.arange(n), m), np.tile(np.arange(m), n)
    probs = state.scorer.predict(rows, cols, state.network.probabilities(rows, cols))
    expected = (probs @ state.network.levels).reshape(n, m)
    baseline = np.stack([state.baseline(u, np.arange(m)) for u in range(n)])
    return np.where(state.embedded[None, :], expected, baseline)


def _history(artifact: Artifact) -> tuple[list[tuple[str, str, float | None]], ...]:
    """Two batches of everything a stream holds: new users and items, re-ratings, a retraction, a
    forgotten user, then more of the same users and items."""
    from model.stream import FORGET

    user, item = artifact.users.external, artifact.items.external
    first = [
        *_batch(artifact),
        ("stranger", "gadget", 5.0),  # a new item nobody trained rated: the baseline's
        (user(4), "gizmo", 2.0),  # a new item a trained user rated: embedded
        (user(2), item(5), 4.0),
        (user(2), item(5), None),  # taken back
        ("leaver", item(1), 3.0),
        ("leaver", FORGET, None),
    ]
    second = [
        ("newcomer", item(9), 4.0),
        (user(6), "gizmo", 5.0),
        ("stranger", item(2), 1.0),
        (user(4), item(int(artifact.train.cols[0])), None),
    ]
    return first, second


@pytest.mark.parametrize("sparse", [False, True])
def test_a_restored_snapshot_is_the_state_it_was_taken_of_and_goes_on_alike(
    artifact: Artifact, sparse: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from model import exact

    if sparse:  # the user table turns sparse as users arrive: its cut depends on the batches, so stored
        monkeypatch.setattr(exact.affinity, "DENSE_TABLE_MAX", artifact.config.n_users + 1)
    overrides = {**EXACT, "kernel.co_rating_user": 5.0, "kernel.co_rating": 3.0, "output.baseline": 0.3}
    first, second = _history(artifact)
    taken, _ = _fold(artifact, overrides)
    taken.apply(first[:4])
    taken.apply(first[4:])
    applied, payload = taken.snapshot()
    restored, _ = _fold(artifact, overrides)
    assert restored.restore(payload) == applied == taken.state.applied == len(first)
    a, b = taken.state, restored.state
    table_a, table_b = (s.scorer.lines.user_affinity for s in (a, b))  # type: ignore[attr-defined]
    assert isinstance(table_b, exact.SparseAffinity if sparse else exact.DenseAffinity)
    np.testing.assert_allclose(table_a.toarray(), table_b.toarray(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(_answers(taken), _answers(restored), rtol=0, atol=1e-9)
    assert (a.online, a.changed, a.items_changed, a.forgotten) == (
        b.online,
        b.changed,
        b.items_changed,
        b.forgotten,
    )
    for name in ("newcomer", "stranger", "leaver"):
        assert taken.user_index(name) == restored.user_index(name)
    assert (
        restored.item_indices(["gadget", "gizmo"]).tolist()
        == taken.item_indices(["gadget", "gizmo"]).tolist()
    )
    # The stream's later entries fold into both alike.
    taken.apply(second)
    restored.apply(second)
    np.testing.assert_allclose(_answers(taken), _answers(restored), rtol=0, atol=1e-9)
    if not sparse:  # and, the dense table following the ratings alone, as one replay of everything
        replayed, _ = _fold(artifact, overrides)
        replayed.apply(first + second)
        np.testing.assert_allclose(_answers(replayed), _answers(restored), rtol=0, atol=1e-9)


def test_a_snapshot_that_does_not_fit_is_refused_and_changes_nothing(artifact: Artifact) -> None:
    import io

    from model.online import SnapshotError

    taken, _ = _fold(artifact, EXACT)
    taken.apply(_batch(artifact))
    _, payload = taken.snapshot()
    with np.load(io.BytesIO(payload)) as npz:
        arrays = {name: npz[name] for name in npz.files}

    def saved(**changes: np.ndarray) -> bytes:
        out = io.BytesIO()
        np.savez(out, **{**arrays, **changes})
        return out.getvalue()

    fmt = arrays["format"].copy()
    later, other_matrix = fmt.copy(), fmt.copy()
    later[0] += 1
    other_matrix[3] += 1
    cases = {
        "not a fold-in snapshot": payload[: len(payload) // 2],
        "layout": saved(format=later),
        "another artifact": saved(format=other_matrix),
        "user_emb is": saved(user_emb=arrays["user_emb"][:-1]),
        "outside": saved(online_cols=arrays["online_cols"] + 10_000),
        "do not fit together": saved(online_values=arrays["online_values"][:-1]),
    }
    for reason, bad in cases.items():
        fresh, _ = _fold(artifact, EXACT)
        before = fresh.state
        with pytest.raises(SnapshotError, match=reason):
            fresh.restore(bad)
        assert fresh.state is before and fresh.n_users == artifact.config.n_users
    with pytest.raises(SnapshotError, match="applied nothing"):
        taken.restore(payload)
