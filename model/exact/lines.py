"""The kernel's line and co-rating terms together (`Lines`): which are on, their tables, and their messages
to a batch of queries.

The maths: the package docstring (model/exact/__init__.py) and docs/model.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from model.engine import (
    in_order,
    one_row,
)
from model.exact.affinity import Affinity
from model.exact.messages import (
    ColumnMajor,
    Distributions,
    _segment_sums,
    affinity_messages,
    column_pass,
    line_messages,
    member_weights,
)
from model.ratings import Ratings
from model.types import FloatArray, IntArray


@dataclass(frozen=True)
class Lines:
    """The kernel's same-user, same-item and co-rating terms over the known entries (module docstring)."""

    same_user: float
    same_item: float
    known: Ratings
    co_rating: float = 0.0
    affinity: Affinity | None = None  # (m, m) co-rating weights w(j, j'); needed when co_rating > 0
    co_rating_prior: float = 0.0  # pseudo-count c: the normaliser gains (lambda_r + lambda_c) c
    co_rating_user: float = 0.0  # lambda_c, the user-based term's weight
    user_affinity: Affinity | None = None  # (n, n) user co-rating weights; needed when co_rating_user > 0

    @property
    def active(self) -> bool:
        """Whether any term has a weight."""
        return self.same_user > 0 or self.same_item > 0 or self.co_rating > 0 or self.co_rating_user > 0

    @property
    def column_terms(self) -> bool:
        """Whether a term sums over the query's column (same-item, user co-rating)."""
        return self.same_item > 0 or (self.co_rating_user > 0 and self.user_affinity is not None)

    @property
    def prior_weight(self) -> float:
        """What the co-rating pseudo-count adds to the normaliser: (lambda_r + lambda_c) c."""
        return (self.co_rating + self.co_rating_user) * self.co_rating_prior

    def user_sums(
        self, user: int, weights: Distributions, b: FloatArray, with_total: bool = False
    ) -> FloatArray:
        """sum over the user's known l of w_l b_{j_l}: (p, D), with the sum of b_{j_l} alone as row p when
        `with_total`. The same-user term of a query (user, j) is lambda_u b_j . (row u), a read like the
        field's."""
        members = self.known.by_row.of(user)
        w = member_weights(weights, members, with_total)
        out: FloatArray = w.T @ np.take(b, self.known.cols[members], axis=0)
        return out

    def column_weights(
        self, user: int, a: FloatArray, similar: Callable[[int], FloatArray] | None = None
    ) -> FloatArray:
        """e = lambda_i s_r(user, .) + lambda_c w_u(user, .) over the known users: the weight of each known
        entry's user in both column terms of one user's queries (`similar(user)`: s_r, when the caller
        reads it for less than a . a_user)."""
        n = self.known.n_users
        e = np.zeros(n)
        if self.same_item > 0:
            e += self.same_item * (similar(user)[:n] if similar is not None else a[:n] @ a[user])
        if self.co_rating_user > 0 and self.user_affinity is not None:
            self.user_affinity.add_line(e, user, self.co_rating_user)
        return e

    def messages(
        self,
        weights: Distributions,
        a: FloatArray,
        b: FloatArray,
        rows: IntArray,
        cols: IntArray,
        with_total: bool = False,
        columns: ColumnMajor | None = None,
        same_user: bool = True,
        similar: Callable[[int], FloatArray] | None = None,
    ) -> FloatArray:
        """lambda_u sum_{l on row i} s_c(j, j_l) w_l + lambda_i sum_{l on col j} s_r(i, i_l) w_l
        + lambda_r sum_{l on row i} w(j, j_l) w_l + lambda_c sum_{l on col j} w_u(i, i_l) w_l: (K, p);
        `with_total` appends the same sums of the similarities alone (the normaliser's share).

        `columns`: `weights` in item order. When one user's queries reach most of the known entries
        through their columns (a top-N over the catalogue), both column terms are then one `column_pass`
        with the per-user weights lambda_i s_r(i, .) + lambda_c w_u(i, .). `same_user=False` leaves the
        first term out (the caller read it with the field: `user_sums`). `similar(i)`: s_r(i, .) over the
        users, when the caller reads it for less than a . a_i (`Network.user_similarities`)."""
        known = self.known
        out = np.zeros((len(rows), weights.shape[1] + int(with_total)))
        column_terms = self.column_terms
        one = one_row(rows)
        user = one if column_terms else None
        # One user's queries over every item in order (a top-N): arrays over the catalogue are the answer
        # as they are (the item co-rating term adds only the user's items' neighbours: affinity_messages).
        catalogue = one is not None and in_order(cols, known.n_items)
        # One user's queries: both column terms weigh the entry l by e[i_l] = lambda_i s_r(i, i_l) +
        # lambda_c w_u(i, i_l), one vector over the users. Read with it when the queries' columns hold
        # many known entries (a dense matrix's items): for most of the entries, one pass over all of them;
        # else the columns' members gathered, a number each, not an embedding each (`line_messages`).
        reached = 0 if user is None else len(known) if catalogue else int(known.by_col.counts(cols).sum())
        whole = columns is not None and 4 * reached > len(known)
        if user is not None and (whole or 4 * reached > known.n_users):
            e = self.column_weights(user, a, similar)
            if whole and catalogue:
                assert columns is not None
                out = column_pass(columns, e, with_total)  # every column, in order: the sums themselves
            elif whole:
                assert columns is not None
                out += column_pass(columns, e, with_total)[cols]
            else:
                members, counts = known.by_col.members(cols)
                vals = member_weights(weights, members, with_total)
                out += _segment_sums(e[known.rows[members]][:, None] * vals, counts)
            column_terms = False
        if self.same_user > 0 and same_user:
            user_term = line_messages(known.by_row, b, known.cols, weights, rows, b[cols], with_total)
            out += self.same_user * user_term
        if self.same_item > 0 and column_terms:
            item = line_messages(known.by_col, a, known.rows, weights, cols, a[rows], with_total)
            out += self.same_item * item
        if self.co_rating > 0 and self.affinity is not None:
            affinity_messages(
                known.by_row, self.affinity, known.cols, weights, rows, cols, with_total, out, self.co_rating
            )
        if self.co_rating_user > 0 and self.user_affinity is not None and column_terms:
            affinity_messages(
                known.by_col, self.user_affinity, known.rows, weights, cols, rows, with_total, out,
                self.co_rating_user,
            )  # fmt: skip
        return out
