"""Ratings that arrive after training, folded into the model without retraining.

The artifact is the state up to training; every rating since (from any writer, in one global order) is
applied on top of it by `FoldIn.apply`:

- the rating joins the known ratings; a re-rating of the same (user, item) replaces the earlier one,
  the artifact's included;
- the user's embedding is recomputed by the row branch (the exported ONNX graph) from the updated rating
  row, i.e. the network's input: the user's training ratings with the online ones added or replacing
  them. The row branch embeds any rating row, so a user id the artifact never saw gets the next index and
  an embedding from its first rating on;
- the inference mode's scorer takes the change (`updated`): the exact CRF's known field by the changed
  users' terms alone (model/exact.py), the paper's partitions drawn again.

Each state is a new immutable `OnlineState`, published by one assignment: a reader takes `fold.state`
once and sees one consistent model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from model.artifact import Artifact
from model.config import InferenceConfig
from model.engine import Network
from model.ratings import Ratings
from model.scorers import Scorer, artifact_scorer
from model.types import Array, IntArray

EmbedRows = Callable[[Array], Array]
"""The row branch: dense rating rows (b, m) float32 -> user embeddings (b, d) float32."""


@dataclass(frozen=True)
class OnlineState:
    """The model with every online rating applied so far."""

    network: Network
    known: Ratings
    scorer: Scorer
    applied: int
    """How many online ratings this state includes."""


class FoldIn:
    """An artifact's model that takes ratings online (see the module docstring)."""

    def __init__(self, artifact: Artifact, inference: InferenceConfig, embed_rows: EmbedRows) -> None:
        self.artifact = artifact
        self._embed_rows = embed_rows
        network, scorer = artifact_scorer(artifact, inference)
        self._base = artifact.known()
        self._keep = np.ones(len(self._base), dtype=bool)  # artifact ratings not re-rated online
        self._ids = list(artifact.users.ids)
        self._index = {user: i for i, user in enumerate(self._ids)}
        self._online: dict[int, dict[int, float]] = {}  # user -> item -> latest online rating
        self._lock = threading.Lock()
        self.state = OnlineState(network, self._base, scorer, 0)

    @property
    def n_users(self) -> int:
        """Users known so far: the artifact's, then the new ones in order of their first rating."""
        return len(self._ids)

    def user_index(self, user: str) -> int | None:
        """The index of an external user id, or None when no rating of it is known."""
        return self._index.get(user)

    def user_id(self, index: int) -> str:
        """The external id of a user index."""
        return self._ids[index]

    def online_count(self, user: int) -> int:
        """How many items the user rated online."""
        return len(self._online.get(user, ()))

    def online_ratings(self, user: int) -> dict[int, float]:
        """The user's online ratings by item (a copy)."""
        with self._lock:
            return dict(self._online.get(user, {}))

    def apply(self, ratings: Sequence[tuple[str, int, float]]) -> None:
        """Fold in (external user id, item index, rating) triples, in order; later ones win."""
        if not ratings:
            return
        with self._lock:
            touched: set[int] = set()
            for user, item, value in ratings:
                i = self._index.get(user)
                if i is None:
                    i = self._index[user] = len(self._ids)
                    self._ids.append(user)
                self._online.setdefault(i, {})[int(item)] = float(value)
                touched.add(i)
            users = np.array(sorted(touched), dtype=np.int64)
            known = self._known(users)
            network = self._network(users)
            old = self.state
            scorer = old.scorer.updated(network, known, users)
            self.state = OnlineState(network, known, scorer, old.applied + len(ratings))

    def _known(self, users: IntArray) -> Ratings:
        """The artifact's known ratings less those re-rated online, then every online rating."""
        base = self._base
        for user in users:
            if user < base.n_users:
                pos = base.by_row.of(int(user))
                rerated = np.isin(base.cols[pos], np.fromiter(self._online[int(user)], dtype=np.int64))
                self._keep[pos[rerated]] = False
        rows, cols, values = [], [], []
        for user, items in self._online.items():
            rows.append(np.full(len(items), user, dtype=np.int64))
            cols.append(np.fromiter(items.keys(), dtype=np.int64, count=len(items)))
            values.append(np.fromiter(items.values(), dtype=np.float64, count=len(items)))
        keep = self._keep
        return Ratings(
            np.concatenate([base.rows[keep], *rows]),
            np.concatenate([base.cols[keep], *cols]),
            np.concatenate([base.values[keep], *values]),
            len(self._ids),
            base.n_items,
        )

    def _network(self, users: IntArray) -> Network:
        """The network with the changed users' embeddings recomputed by the row branch (rows grown for new
        users)."""
        old = self.state.network
        train = self.artifact.train
        dense = np.zeros((len(users), train.n_items), dtype=np.float32)
        existing = users < train.n_users
        if existing.any():
            dense[existing] = train.dense_rows(users[existing])
        for k, user in enumerate(users):
            items = self._online[int(user)]
            cols = np.fromiter(items.keys(), dtype=np.int64)
            dense[k, cols] = np.fromiter(items.values(), dtype=np.float32)
        embedded = np.asarray(self._embed_rows(dense), dtype=np.float32).astype(np.float64)
        user_emb = old.user_emb
        if len(self._ids) > len(user_emb):
            user_emb = np.vstack([user_emb, np.zeros((len(self._ids) - len(user_emb), user_emb.shape[1]))])
        else:
            user_emb = user_emb.copy()
        user_emb[users] = embedded
        return Network(old.config, user_emb, old.item_emb, old.bilinear)
