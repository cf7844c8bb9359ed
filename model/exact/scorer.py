"""The `exact` mode's scorer: everything a query needs, computed once per network and known ratings (or
taken from the artifact), and updated as ratings arrive online.

The maths: the package docstring (model/exact/__init__.py) and docs/model.md."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import scipy.sparse as sp

from model.artifact import StoredField
from model.config import Crf, KernelSettings, OutputSettings
from model.engine import (
    Network,
    compatibility_matrix,
    in_order,
    one_row,
    row_products,
)
from model.exact import direct
from model.exact.affinity import Affinity, SparseAffinity
from model.exact.baseline import BiasModel, baseline_mixture
from model.exact.explain import Explanation, explain
from model.exact.field import KnownField, LevelInterpolation, known_field
from model.exact.gram import CoRatingGram, centred_norms, co_rating_affinity, co_rating_rows
from model.exact.lines import Lines
from model.exact.messages import ClampedRows, ColumnMajor, Distributions, FactorizedGraph, clamped_sums
from model.exact.posterior import posterior, query_distributions, user_distributions
from model.ratings import Ratings
from model.types import FloatArray, IntArray

PARTS_RESUM_STEPS = 32
"""Updates a user's row terms take by their changed ratings (`row_parts(previous=)`) before they are summed
whole again: rounding stays that of a few dozen additions."""


@dataclass(frozen=True)
class FieldKey:
    """What a known field depends on beyond the network and the known ratings. Stored as JSON beside the
    field, so a field computed for other settings is recomputed rather than reused; settings that cannot
    change the field (the co-rating exponent without a co-rating term, the scale unless `scaled`) are 0."""

    scaling: str
    known: str
    gamma: float
    layers: int
    tau: float
    scale: float
    same_user: float
    same_item: float
    co_rating: float
    co_rating_user: float
    co_rating_power: float
    co_rating_shrink: float
    co_rating_prior: float
    n_known: int

    @classmethod
    def of(cls, crf: Crf, kernel: KernelSettings, scale: float, n_known: int) -> FieldKey:
        """The key of a field computed under these settings."""
        co_rated = kernel.co_rating > 0 or kernel.co_rating_user > 0
        return cls(
            scaling=kernel.scaling,
            known=kernel.known,
            gamma=float(crf.gamma),
            layers=int(crf.layers),
            tau=float(crf.tau),
            scale=float(scale) if kernel.scaling == "scaled" else 0.0,
            same_user=kernel.same_user,
            same_item=kernel.same_item,
            co_rating=kernel.co_rating,
            co_rating_user=kernel.co_rating_user,
            co_rating_power=kernel.co_rating_power if co_rated else 0.0,
            co_rating_shrink=kernel.co_rating_shrink if co_rated else 0.0,
            co_rating_prior=kernel.co_rating_prior if co_rated else 0.0,
            n_known=n_known,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FieldKey | None:
        """The key stored with a field; None when it is not a key of this version (then recompute)."""
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            return None
        try:
            return cls(**d)
        except TypeError:
            return None


class ExactParts:
    """What the `exact` scorers of one network and one set of known ratings share whatever their settings:
    the lifted embeddings, the co-rating grams (`CoRatingGram`), the clamped field's per-label aggregates
    and the bias baselines. Each is built on first use, once. A search over the settings
    (training/tune.py) builds one `ExactScorer` per trial from them in milliseconds instead of seconds.

    The clamped field is linear in the compatibility: with A_l = sum over the entries labelled l of
    a_i b_j^T, G_u = sum_l C[u, l] A_l for any C (any tau)."""

    def __init__(self, network: Network, known: Ratings) -> None:
        self.network, self.known = network, known
        self.user_lifted, self.item_lifted = network.user_lifted, network.item_lifted
        self.labels = known.labels(network.levels)
        self._grams: dict[str, CoRatingGram] = {}
        self._per_label: tuple[FloatArray, FloatArray] | None = None
        self._label_matrix: sp.csr_matrix | None = None
        self._biases: dict[tuple[float, float], BiasModel] = {}

    def table(self, what: str, power: float, shrink: float) -> Affinity:
        """The co-rating table of the items (`items`) or of the users (`users`)."""
        gram = self._grams.get(what)
        if gram is None:
            known, net = self.known, self.network
            if what == "items":
                gram = CoRatingGram.of(known.rows, known.cols, known.values, net.n_users, net.n_items)
            else:
                gram = CoRatingGram.of(known.cols, known.rows, known.values, net.n_items, net.n_users, what)
            self._grams[what] = gram
        return gram.table(power, shrink)

    def label_matrix(self, p: int) -> sp.csr_matrix:
        """`ColumnMajor.label_matrix` of the known entries (p levels), built on first use."""
        if self._label_matrix is None or self._label_matrix.shape[0] != self.known.n_items * p:
            self._label_matrix = ColumnMajor.label_matrix(self.known, self.labels, p)
        return self._label_matrix

    def clamped_field(self, compat: FloatArray) -> tuple[FloatArray, FloatArray]:
        """(G, H) of the known entries clamped to their labels, under the compatibility `compat`."""
        if self._per_label is None:
            graph = FactorizedGraph(self.user_lifted, self.item_lifted, self.known.rows, self.known.cols)
            onehot = np.zeros((len(self.labels), len(compat)))
            onehot[np.arange(len(self.labels)), self.labels] = 1.0
            self._per_label = graph.aggregate(onehot), graph.total()
        per_label, h = self._per_label
        g: FloatArray = np.einsum("ul,lde->ude", compat, per_label)
        return g, h

    def biases(self, user_shrink: float, item_shrink: float) -> BiasModel:
        """The bias baseline of the known ratings with these penalties."""
        key = (user_shrink, item_shrink)
        if key not in self._biases:
            known, net = self.known, self.network
            self._biases[key] = BiasModel.fit(
                known.rows, known.cols, known.values, net.n_users, net.n_items, user_shrink, item_shrink
            )
        return self._biases[key]


USER_TABLE_MAX_BYTES = 64 * 2**20
"""The largest table of every user's query vectors (`query_vectors`) a state keeps: 16.5 MB on ML-100K
with two settings averaged; an ml-10m- or Epinions-shaped artifact (tens of thousands of users) computes
each user's vectors per query instead."""


def query_vectors(members: Sequence[ExactScorer]) -> FloatArray | None:
    """(n, Q, D): for every user, each member's field vectors (a_user^T G_u of its levels, the normaliser's
    after them under `normalized`: `ExactScorer.vectors` without the same-user term) one member after the
    other, then the decoder's probe (`ExactScorer.probe`); None when it would exceed USER_TABLE_MAX_BYTES.
    Two matrix products over the user table per member: the numbers of `vectors` and `probe` to rounding.
    The members share one network."""
    first = members[0]
    net = first.network
    n, width = first.user_lifted.shape
    p, d = net.bilinear.shape[0], net.bilinear.shape[1]
    rows = sum(m.field_rows for m in members) + p
    if n * rows * width * 8 > USER_TABLE_MAX_BYTES:
        return None
    out = np.empty((n, rows, width))
    at = 0
    for member in members:
        stacked = member.field.stacked(member.kernel.scaling == "normalized")  # (L, D, D)
        levels = len(stacked)
        flat = np.ascontiguousarray(stacked.transpose(1, 0, 2)).reshape(width, levels * width)
        out[:, at : at + levels] = (first.user_lifted @ flat).reshape(n, levels, width)
        at += levels
    decoder = np.ascontiguousarray(net.bilinear.transpose(1, 0, 2)).reshape(d, p * d)
    out[:, at:, 0] = 0.0
    out[:, at:, 1:] = (np.asarray(net.user_emb, dtype=np.float64) @ decoder).reshape(n, p, d) * np.sqrt(2.0)
    return out


@dataclass(frozen=True)
class RowParts:
    """The part of one user's answers that other users' ratings leave as it is (`ExactScorer.row_parts`):
    valid while the user's ratings and embedding and the items stay the same."""

    user: int
    scores: FloatArray
    """(m, p) the decoder's scores u^T B_l v_j of every item."""
    own: FloatArray | None
    """(m, p [+ 1]) the row terms' sums over every item (same-user, item co-rating; with the normaliser's
    share as column p under `normalized`), or None without them."""
    rated: tuple[IntArray, IntArray] | None = None
    """(items, labels) of the user's known ratings that `own` sums over, so that a later `row_parts` of
    the same items can add the changed ratings' terms to `own` instead of summing them all again."""
    steps: int = 0
    """How many such updates `own` has had since it was last summed whole."""

    @property
    def nbytes(self) -> int:
        rated = 0 if self.rated is None else self.rated[0].nbytes + self.rated[1].nbytes
        return int(self.scores.nbytes + (0 if self.own is None else self.own.nbytes) + rated)


class ExactScorer:
    """The `exact` mode over one network and its known ratings: everything a query needs (the known
    field, the kernel's tables, the bias baseline) is computed at construction, taken from the artifact's
    stored field when its key matches, or (clamped known entries) assembled from shared `parts`."""

    def __init__(
        self,
        network: Network,
        known: Ratings,
        crf: Crf,
        kernel: KernelSettings,
        output: OutputSettings,
        scale: float = 1.0,
        stored: StoredField | None = None,
        parts: ExactParts | None = None,
    ) -> None:
        if parts is None:
            known = known.compact()  # what reads the whole arrays below: one position per rating
        self.network, self.known, self.crf = network, known, crf
        self.kernel, self.output = kernel, output
        if parts is not None and (parts.network is not network or parts.known is not known):
            raise ValueError("the parts belong to another network or other known ratings")
        self.parts = parts
        self.users: FloatArray | None = None
        """`prepare`'s table of every user's query vectors (`query_vectors`), or None."""
        if parts is not None:
            self.user_lifted, self.item_lifted = parts.user_lifted, parts.item_lifted
        else:
            self.user_lifted = network.user_lifted  # a_i = [1, u_i] / sqrt(2): s_r = a_i . a_i'
            self.item_lifted = network.item_lifted
        self.compat = compatibility_matrix(network.levels, crf.tau)
        counts = np.bincount(known.cols, minlength=network.n_items)
        sums = np.bincount(known.cols, weights=known.values, minlength=network.n_items)
        self._item_means = sums / np.maximum(counts, 1)  # what centres the user table's ratings
        self._user_norms: FloatArray | None = None  # their norms per user, once an update needed them
        self.key = FieldKey.of(crf, kernel, scale, len(known))
        stored_key = FieldKey.from_json(stored.key) if stored is not None else None
        matches = stored is not None and stored_key == self.key
        self.lines = self._lines(stored=stored.tables if stored is not None and matches else None)
        needs_t = self.lines is not None and self.lines.active
        clamped = kernel.known == "clamped"
        labels = parts.labels if parts is not None else known.labels(network.levels)
        # The item-ordered copy of the clamped entries that one user's catalogue read takes: built once
        # per `parts` (a search's trials share it), not once per trial.
        matrix = None
        if clamped and parts is not None and self.lines is not None and self.lines.column_terms:
            matrix = parts.label_matrix(len(self.compat))
        by_label = (labels, self.compat, matrix) if clamped else (None, None, None)
        # Clamped entries' t follows from their labels (`ClampedRows`): never stored, never an array.
        clamped_t = ClampedRows(labels, self.compat) if clamped and needs_t else None
        given: tuple[FloatArray, FloatArray, Distributions | None] | None = None  # (g, h, t) taken
        if matches and stored is not None and (clamped or (stored.t is not None) == needs_t):
            given, self.field_source = (stored.g, stored.h, clamped_t if clamped else stored.t), "artifact"
        elif parts is not None and kernel.known == "clamped":
            given, self.field_source = (*parts.clamped_field(self.compat), clamped_t), "parts"
        if given is not None:
            g, h, t = given
            self.field = KnownField(
                g=g, h=h, scaling=kernel.scaling, scale=scale, t=t, interp=LevelInterpolation.of(self.compat)
            ).with_columns(self.lines, *by_label)
        else:
            self.field = self._known_field(scale)
            self.field_source = "computed"
        self.biases: BiasModel | None = None
        same_known = stored_key is not None and stored_key.n_known == len(known)
        kept = stored.biases if stored is not None and same_known else None
        penalties = (output.baseline_user_shrink, output.baseline_item_shrink)
        if output.baseline > 0 and parts is not None:
            self.biases = parts.biases(*penalties)
        elif output.baseline > 0 and kept is not None and (kept.user_shrink, kept.item_shrink) == penalties:
            self.biases = BiasModel(kept.mu, kept.users, kept.items, *penalties)  # the artifact's fit
        elif output.baseline > 0:
            self.biases = BiasModel.fit(
                known.rows, known.cols, known.values, network.n_users, network.n_items, *penalties
            )

    def updated(
        self,
        network: Network,
        known: Ratings,
        users: IntArray,
        items: IntArray | None = None,
        tables: Mapping[str, np.ndarray] | None = None,
    ) -> ExactScorer:
        """The scorer once ratings arrived online: `network` and `known` include them (users and items may
        have been added at the end); `users` are those whose ratings or embeddings changed, `items` those
        whose embeddings changed; `tables`: what `online_tables` of the scorer that took them returned
        (a restored snapshot), used instead of recomputing it.

        With clamped known entries and normalized or summed messages the field changes by the terms of the
        entries on those rows and columns alone: their old terms out, their new ones (new ratings, new
        embeddings) in, in O(|those entries| D p + |users| D^2 p). It is never rebuilt. Otherwise (known
        entries updated by the network, or messages scaled by n x m) it is recomputed. The co-rating tables
        stay those of the artifact's ratings until the next training (new users and items have no
        neighbours in them); the bias baseline refits the changed users' biases against the item biases."""
        items = np.empty(0, dtype=np.int64) if items is None else np.asarray(items, dtype=np.int64)
        users = np.asarray(users, dtype=np.int64)
        new = copy.copy(self)
        new.network, new.known, new.parts, new.users = network, known, None, None
        new.user_lifted, new.item_lifted = network.user_lifted, network.item_lifted
        new.lines = new._lines(self.lines)
        stored = dict(tables or {})
        if new.lines is not None and new.lines.user_affinity is not None and "user_table_data" in stored:
            n = network.n_users
            matrix = sp.csr_matrix(
                (stored["user_table_data"], stored["user_table_indices"], stored["user_table_indptr"]),
                shape=(n, n),
            )
            new.lines = dataclasses.replace(new.lines, user_affinity=SparseAffinity(matrix))
        elif new.lines is not None and new.lines.user_affinity is not None and len(users):
            # The changed users' rows of the user table follow their new ratings. The ratings are centred
            # by the item means the table was built with, so an entry depends on its two users' ratings
            # alone, and a dense table on the ratings, not on how they arrived (a sparse one keeps each
            # line's strongest pairs as of its last change).
            k = self.kernel
            means = np.full(network.n_items, self._item_means.mean() if len(self._item_means) else 0.0)
            means[: len(self._item_means)] = self._item_means

            norms = new._user_norms = self._user_norms_after(known, means, users)

            def fresh(lo: int, hi: int) -> FloatArray:
                return co_rating_rows(
                    known.cols, known.rows, known.values, network.n_items, network.n_users, users[lo:hi],
                    k.co_rating_power, k.co_rating_shrink, mean=means, by_row=known.by_col,
                    by_col=known.by_row, norms=norms,
                )  # fmt: skip

            table = new.lines.user_affinity.with_lines(users, fresh)
            new.lines = dataclasses.replace(new.lines, user_affinity=table)
        scale = (
            self.field.scale
            * self.network.n_users
            * self.network.n_items
            / (network.n_users * network.n_items)
        )
        if self.kernel.known == "clamped" and self.kernel.scaling != "scaled":
            left, joined = self._entries(users, items), new._entries(users, items)
            moved = self._terms_moved(new, left, joined, len(items) > 0)  # new terms less the old ones
            lines_on = new.lines is not None and new.lines.active
            labels = known.labels(network.levels)
            t_all = ClampedRows(labels, self.compat) if lines_on else None
            columns = None
            if new.lines is not None and new.lines.column_terms:
                held = self.field.columns
                if held is not None and held.by_label is not None:  # the entries on those lines changed
                    columns = held.changed(left, joined, known, labels)
                else:
                    columns = ColumnMajor.clamped(known, labels, self.compat)
            new.field = KnownField(
                g=self.field.g + moved[:-1],
                h=self.field.h + moved[-1],
                scaling=self.kernel.scaling,
                scale=scale,
                t=t_all,
                interp=self.field.interp,
                columns=columns,
            )
        else:  # recomputed over the whole arrays: one position per rating
            new.known = known = known.compact()
            if new.lines is not None:
                new.lines = dataclasses.replace(new.lines, known=known)
            new.field = new._known_field(scale)
        new.field_source = "online"
        if self.biases is not None:

            def rated(user: int) -> tuple[IntArray, FloatArray]:
                pos = known.by_row.of(user)
                return known.cols[pos], known.values[pos]

            new.biases = self.biases.grown(network.n_users, network.n_items).with_users(users.tolist(), rated)
        return new

    def _user_norms_after(self, known: Ratings, means: FloatArray, users: IntArray) -> FloatArray:
        """Each user's norm of its ratings centred by `means` (the user table's cosines divide by them)
        in `known`, where only `users` changed since this scorer's known ratings: this scorer's norms
        with theirs summed again (the first time, every user's: O(N) once)."""
        held = self._user_norms
        if held is None:
            return centred_norms(known.by_row, known.cols, known.values, means, np.arange(known.n_users))
        norms = np.zeros(known.n_users)
        norms[: len(held)] = held
        norms[users] = centred_norms(known.by_row, known.cols, known.values, means, users)
        return norms

    def _entries(self, users: IntArray, items: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """(rows, cols, labels) of the known entries on the rows `users` or the columns `items` (users and
        items beyond this scorer's matrix have none)."""
        known = self.known
        on_rows, _ = known.by_row.members(users[users < known.n_users])
        on_cols, _ = known.by_col.members(items[items < known.n_items])
        pos = np.union1d(on_rows, on_cols)
        return known.rows[pos], known.cols[pos], known.labels(self.network.levels)[pos]

    def _terms_moved(
        self,
        new: ExactScorer,
        left: tuple[IntArray, IntArray, IntArray],
        joined: tuple[IntArray, IntArray, IntArray],
        items_changed: bool,
    ) -> FloatArray:
        """What the clamped field's (G, H) gain from `self` to `new` by the known entries on the rows and
        columns that changed (`_entries` of both: `left`, `joined`): their terms sum_l t_l a_{i_l}
        b_{j_l}^T in `new` less those in `self`: (p + 1, D, D). Where no item embedding changed, one
        `clamped_sums` of both sets (the old ones weighted -1, each user's old and new embedding as rows of
        their own); else two."""
        old_rows, old_cols, old_labels = left
        new_rows, new_cols, new_labels = joined
        if items_changed:
            old = clamped_sums(
                self.user_lifted, self.item_lifted, old_rows, old_cols, old_labels, self.compat
            )
            fresh = clamped_sums(
                new.user_lifted, new.item_lifted, new_rows, new_cols, new_labels, self.compat
            )
            out: FloatArray = fresh - old
            return out
        old_users, old_at = np.unique(old_rows, return_inverse=True)
        new_users, new_at = np.unique(new_rows, return_inverse=True)
        a = np.concatenate([self.user_lifted[old_users], new.user_lifted[new_users]])
        rows = np.concatenate([old_at, new_at + len(old_users)])
        weights = np.concatenate([np.full(len(old_rows), -1.0), np.ones(len(new_rows))])
        cols, labels = np.concatenate([old_cols, new_cols]), np.concatenate([old_labels, new_labels])
        out = clamped_sums(a, new.item_lifted, rows, cols, labels, self.compat, weights)
        return out

    def _lines(
        self,
        tables: Lines | None = None,
        stored: dict[str, tuple[FloatArray, IntArray, FloatArray]] | None = None,
    ) -> Lines | None:
        """The kernel's line and co-rating terms (None when every weight is 0), with their tables: those
        of `tables` when given (the user table grows by zero rows and columns for new users), else the
        artifact's `stored` sparse tables where it holds them, else built here."""
        k, known, net = self.kernel, self.known, self.network
        if not any((k.same_user, k.same_item, k.co_rating, k.co_rating_user)):
            return None
        if tables is not None:
            items = None if tables.affinity is None else tables.affinity.grown(net.n_items)
            users = None if tables.user_affinity is None else tables.user_affinity.grown(net.n_users)
        else:
            stored = stored or {}
            items = self._table("items", stored.get("items")) if k.co_rating > 0 else None
            users = self._table("users", stored.get("users")) if k.co_rating_user > 0 else None
        return Lines(
            k.same_user, k.same_item, known, k.co_rating, items, k.co_rating_prior, k.co_rating_user, users
        )

    def _table(self, what: str, stored: tuple[FloatArray, IntArray, FloatArray] | None = None) -> Affinity:
        """The co-rating table of the items or the users (`co_rating_affinity`): the `stored` one (CSR
        arrays), or from `parts` when given, or built."""
        k, known, net = self.kernel, self.known, self.network
        if stored is not None:
            size = net.n_items if what == "items" else net.n_users
            return SparseAffinity(sp.csr_matrix(stored[::-1], shape=(size, size)))
        if self.parts is not None:
            return self.parts.table(what, k.co_rating_power, k.co_rating_shrink)
        if what == "items":
            return co_rating_affinity(
                known.rows, known.cols, known.values, net.n_users, net.n_items,
                k.co_rating_power, k.co_rating_shrink,
            )  # fmt: skip
        return co_rating_affinity(
            known.cols, known.rows, known.values, net.n_items, net.n_users,
            k.co_rating_power, k.co_rating_shrink, what="users",
        )  # fmt: skip

    def explain(self, user: int, items: IntArray, k: int) -> list[Explanation]:
        """The `k` known ratings that moved each prediction (user, items[q]) most, with their exact effects
        (model/exact/explain.py)."""
        return explain(self, user, items, k)

    def online_tables(self) -> dict[str, np.ndarray]:
        """What `updated` built that the ratings alone do not give back (the sparse user table keeps each
        line's strongest pairs as of its last change, so it depends on how ratings were batched): a
        snapshot stores it and a restore passes it back (`updated(..., tables=)`). A dense table follows
        from the ratings and is recomputed instead."""
        table = None if self.lines is None else self.lines.user_affinity
        if not isinstance(table, SparseAffinity):
            return {}
        m = table.csr()
        return {"user_table_indptr": m.indptr, "user_table_indices": m.indices, "user_table_data": m.data}

    def sparse_tables(self) -> dict[str, tuple[IntArray, IntArray, FloatArray]]:
        """The scorer's sparse co-rating tables as CSR arrays (indptr, indices, data), to be stored with
        its field (`model.artifact.save_known_field`); dense ones are quick to rebuild and are not."""
        out = {}
        if self.lines is not None:
            for what, table in (("items", self.lines.affinity), ("users", self.lines.user_affinity)):
                if isinstance(table, SparseAffinity):
                    m = table.csr()
                    out[what] = (m.indptr, m.indices, m.data)
        return out

    def _known_field(self, scale: float) -> KnownField:
        known, net = self.known, self.network
        probs = net.probabilities(known.rows, known.cols) if self.kernel.known == "predicted" else None
        return known_field(
            self.user_lifted,
            self.item_lifted,
            known.rows,
            known.cols,
            probs,
            known.labels(net.levels),
            self.compat,
            self.crf.gamma,
            self.crf.layers,
            self.kernel.scaling,
            scale,
            self.kernel.known,
            self.lines,
        )

    blocking = False

    @property
    def baseline_weight(self) -> float:
        """Weight of the bias baseline in `predict` (output.baseline)."""
        return float(self.output.baseline)

    def predict(self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None) -> FloatArray:
        """Final distributions of the queried entries (rows[k], cols[k]), attached to the known field and
        mixed with the bias baseline when output.baseline > 0: (K, p). `query_probs`: the base network's
        distributions of the entries; without them the network's own, read with the messages when the
        queries are one user's (`user_distributions`)."""
        dist, baseline = self.unmixed(rows, cols, query_probs)
        if baseline is None:
            return dist
        return baseline_mixture(dist, baseline, self.network.levels, self.output.baseline)

    def row_parts(self, user: int, previous: RowParts | None = None) -> RowParts | None:
        """What of the user's answers over the whole catalogue depends on the user's own ratings and
        embedding alone (and on the items'), so that it stays valid while other users' ratings arrive: the
        decoder's scores and the row terms (same-user, item co-rating) over every item, float64. None when
        the known entries are not clamped (their distributions then move with every rating).

        `previous`: the user's parts from an earlier state with the same items (embeddings and co-rating
        table): the row terms are then those sums plus the terms of the ratings that changed since (each
        term is one rating's, so the sums are the same to rounding), summed whole again every
        PARTS_RESUM_STEPS updates."""
        if self.kernel.known != "clamped":
            return None
        net, lines = self.network, self.lines
        decoder = np.matmul(net.user_emb[user], net.bilinear)  # (p, d)
        scores = np.asarray(net.item_emb, dtype=np.float64) @ decoder.T  # (m, p)
        if lines is None or self.field.t is None or not (lines.same_user > 0 or lines.co_rating > 0):
            return RowParts(user, scores, None)
        known = self.known
        pos = known.by_row.of(user) if user < known.n_users else np.empty(0, dtype=np.int64)
        rated = (known.cols[pos], known.labels(net.levels)[pos])
        normalized = self.kernel.scaling == "normalized"
        if (
            previous is not None
            and previous.own is not None
            and previous.rated is not None
            and previous.steps < PARTS_RESUM_STEPS
            and len(previous.own) == net.n_items
        ):
            own = self._own_changed(lines, previous.own, previous.rated, rated, normalized)
            return RowParts(user, scores, own, rated, previous.steps + 1)
        row_terms = dataclasses.replace(lines, same_item=0.0, co_rating_user=0.0)
        cols = np.arange(net.n_items, dtype=np.int64)
        rows = np.full(net.n_items, user, dtype=np.int64)
        own = row_terms.messages(self.field.t, self.user_lifted, self.item_lifted, rows, cols, normalized)
        return RowParts(user, scores, own, rated)

    def _own_changed(
        self,
        lines: Lines,
        own: FloatArray,
        was: tuple[IntArray, IntArray],
        now: tuple[IntArray, IntArray],
        normalized: bool,
    ) -> FloatArray:
        """`own` (the row terms over the ratings `was`, (items, labels)) moved to the ratings `now`: each
        changed rating's term taken out at its old label and added at its new one (a new array)."""
        compat = self.compat
        p = len(compat)
        before = dict(zip(was[0].tolist(), was[1].tolist(), strict=True))
        after = dict(zip(now[0].tolist(), now[1].tolist(), strict=True))
        changed = sorted(j for j in before.keys() | after.keys() if before.get(j) != after.get(j))
        out: FloatArray = np.array(own, dtype=np.float64)
        if not changed:
            return out
        weights = np.zeros((len(changed), p + int(normalized)))
        for k, j in enumerate(changed):
            if j in after:
                weights[k, :p] += compat[after[j]]
            if j in before:
                weights[k, :p] -= compat[before[j]]
            if normalized:
                weights[k, p] = float(j in after) - float(j in before)
        items = np.array(changed, dtype=np.int64)
        if lines.co_rating > 0 and lines.affinity is not None:
            lines.affinity.add_weighted_lines(out, items, lines.co_rating * weights)
        if lines.same_user > 0:  # s_c(j, j_l) = b_j . b_{j_l}: the catalogue times the changed items' sum
            b = self.item_lifted
            out += b @ (lines.same_user * (b[items].T @ weights))
        return out

    def from_parts(self, parts: RowParts, cols: IntArray) -> tuple[FloatArray, FloatArray | None]:
        """`unmixed` of the queries (parts.user, cols[k]) from the user's `row_parts` (taken from this
        scorer or from an earlier one whose user and items were the same): the field's messages and the
        column terms (same-item, user co-rating: other users' ratings) read now, the rest from `parts`. The
        same numbers as `unmixed` to rounding, in float64 throughout."""
        user, f, lines = parts.user, self.field, self.lines
        normalized = self.kernel.scaling == "normalized"
        stacked = f.stacked(normalized)
        forms = row_products(self.item_lifted, np.matmul(self.user_lifted[user], stacked), cols)
        p = f.g.shape[0]
        msg, total = forms[:, :p], (forms[:, p] if normalized else None)
        if lines is not None and lines.active and f.t is not None:
            extra = np.zeros((len(cols), p + int(normalized)))
            if parts.own is not None:
                extra += parts.own[cols]
            if lines.column_terms:
                extra += self._column_terms(user, cols, normalized)
            msg = msg + extra[:, :p]
            if total is not None:
                total = total + extra[:, p] + lines.prior_weight
        if self.kernel.scaling == "scaled":
            msg = msg * f.scale
        elif total is not None:
            msg = msg / np.maximum(total, 1e-12)[:, None]
        dist = posterior(np.array(parts.scores[cols], dtype=np.float64, order="C"), msg, self.crf.gamma)
        if self.biases is None:
            return dist, None
        return dist, self.biases.predict(user, cols)

    def _column_terms(self, user: int, cols: IntArray, with_total: bool) -> FloatArray:
        """The column terms (same-item, user co-rating) of one user's queries: sum over the known l on
        column j of e(i_l) t_l, e = lambda_i s_r(user, .) + lambda_c w_u(user, .) (`Lines.messages`),
        with the sums of e alone after them when `with_total`: (K, p [+ 1]). For clamped entries
        t_l = C[label_l]: the sums of e per label first (one bincount), then C."""
        lines, t, known = self.lines, self.field.t, self.known
        assert lines is not None and isinstance(t, ClampedRows)  # `row_parts`: clamped entries only
        e = lines.column_weights(user, self.user_lifted)
        members, counts = known.by_col.members(cols)
        p = len(t.compat)
        owner = np.repeat(np.arange(len(cols)), counts)
        per_label = np.bincount(
            owner * p + t.labels[members], weights=e[known.rows[members]], minlength=len(cols) * p
        ).reshape(len(cols), p)
        out = per_label @ t.compat
        if with_total:
            out = np.hstack([out, per_label.sum(axis=1, keepdims=True)])
        result: FloatArray = out
        return result

    def prepare(self) -> None:
        """Every user's query vectors (`query_vectors`) in one matrix product, when they fit: what a fused
        answer (`answer`) reads for its user instead of the field's and the decoder's whole matrices."""
        self.users = query_vectors([self]) if self.kernel.known == "clamped" else None

    def vectors(self, user: int, table: FloatArray | None = None) -> FloatArray:
        """What one user's messages read per item: vec (p [+ 1], D) with forms[k] = b_{cols[k]} . vec, the
        field's levels (a_user^T G_u) and the same-user term (lambda_u sum over the user's l of C[label_l]
        b_{j_l}), the normaliser's row last under `normalized` (`answer`). `table`: the field's part, read
        from `query_vectors` (a new array)."""
        f, lines, known = self.field, self.lines, self.known
        normalized = self.kernel.scaling == "normalized"
        vec: FloatArray = np.matmul(self.user_lifted[user], f.stacked(normalized)) if table is None else table
        if lines is not None and lines.same_user > 0 and user < known.n_users:
            assert isinstance(f.t, ClampedRows)  # `answer`: clamped known entries
            vec += lines.same_user * lines.user_sums(user, f.t, self.item_lifted, normalized)
        return vec

    @property
    def field_rows(self) -> int:
        """How many rows `vectors` has: p, and the normaliser's under `normalized`."""
        return len(self.field.g) + int(self.kernel.scaling == "normalized")

    def read(self, cols: IntArray, vectors: FloatArray) -> FloatArray:
        """b_{cols[k]} . vectors[u]: (K, q), float64; the whole item table in order read as it is."""
        b = self.item_lifted
        rows = b if in_order(cols, len(b)) else np.take(b, cols, axis=0)
        out: FloatArray = rows @ vectors.T
        return out

    def probe(self, user: int) -> FloatArray:
        """(p, D): b_j . probe[u] |item_emb_j| = the decoder's score u^T B_l v_j (`user_distributions`)."""
        net = self.network
        decoder = np.matmul(net.user_emb[user], net.bilinear)  # (p, d)
        out: FloatArray = np.empty((len(decoder), decoder.shape[1] + 1))
        out[:, 0] = 0.0
        np.multiply(decoder, np.sqrt(2.0), out=out[:, 1:])
        return out

    def answer(
        self,
        user: int,
        cols: IntArray,
        forms: FloatArray | None = None,
        scores: FloatArray | None = None,
        log_scores: FloatArray | None = None,
    ) -> tuple[FloatArray, FloatArray | None] | None:
        """`unmixed` of one user's queries (user, cols[k]), fused (model/exact/direct.py): the same numbers
        to rounding, in float64, without the catalogue-wide work of `row_parts`. `forms` (K, p [+ 1]):
        b_{cols[k]} . `vectors(user)`, and `scores` (K, p) the decoder's, when the caller read them (a mean
        of settings reads every member's in one product). None when the known entries are not clamped
        (their distributions then follow the network: `unmixed` answers). `log_scores`: the scores'
        floored log-softmax, when the caller has it (`direct.member_answer`)."""
        lines, known = self.lines, self.known
        if self.kernel.known != "clamped":
            return None
        cols = np.asarray(cols, dtype=np.int64)
        if forms is None or scores is None:
            rows = self.field_rows
            if self.users is not None and user < len(self.users):
                held = self.users[user]
                vec, probe = self.vectors(user, held[:rows].copy()), held[rows:]
            else:
                vec, probe = self.vectors(user), self.probe(user)
            read = self.read(cols, np.vstack([vec, probe]))
            forms, scores = read[:, : len(vec)], read[:, len(vec) :] * self.network.item_norms[cols][:, None]
        rated = columns = None
        prior = 0.0
        if lines is not None and lines.active:
            t = self.field.t
            assert isinstance(t, ClampedRows)  # clamped known entries
            if lines.co_rating > 0 and lines.affinity is not None and user < known.n_users:
                pos = known.by_row.of(user)
                items = np.asarray(known.cols[pos], dtype=np.int64)
                rated = (lines.affinity, items, t.labels[pos], lines.co_rating)
            by_label = self.field.columns
            if lines.column_terms and by_label is not None and by_label.by_label is not None:
                matrices = (by_label.by_label, *by_label.changes)
                columns = (matrices, lines.column_weights(user, self.user_lifted))
            elif lines.column_terms:  # (a clamped field always has its by-label form: `with_columns`)
                raise ValueError("a clamped field's column terms need its by-label form")
            prior = lines.prior_weight
        dist = direct.member_answer(
            np.ascontiguousarray(forms),
            np.ascontiguousarray(scores),
            cols,
            rated,
            columns,
            self.compat,
            self.crf.gamma,
            self.kernel.scaling == "normalized",
            self.field.scale if self.kernel.scaling == "scaled" else 1.0,
            prior,
            self.network.n_items,
            log_scores,
        )
        if self.biases is None:
            return dist, None
        return dist, self.biases.predict(user, cols)

    def unmixed(
        self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None
    ) -> tuple[FloatArray, FloatArray | None]:
        """What `predict` mixes: the CRF's distributions (K, p) and the bias baseline's predictions (K,),
        None without one (output.baseline 0). A catalogue's row is kept unmixed (service.scoring), so a
        top-N reads expected ratings, (1 - w) E[CRF] + w clip(baseline), without a mixed (K, p) array."""
        user = one_row(rows) if query_probs is None else None
        if user is not None:
            dist = user_distributions(
                self.field,
                self.network,
                self.user_lifted,
                self.item_lifted,
                user,
                cols,
                self.crf.gamma,
                self.lines,
            )
        else:
            if query_probs is None:
                query_probs = self.network.probabilities(rows, cols)
            dist = query_distributions(
                self.field,
                self.user_lifted,
                self.item_lifted,
                rows,
                cols,
                query_probs,
                self.crf.gamma,
                self.lines,
            )
        if self.biases is None:
            return dist, None
        return dist, self.biases.predict(rows if user is None else user, cols)  # one user's: a number
