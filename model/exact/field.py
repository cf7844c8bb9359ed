"""The known field: the converged mean-field distributions of every known entry, summarised as the D x D
matrices G_u (and h), with the line terms, from which any query's message is read.

The maths: the package docstring (model/exact/__init__.py) and docs/model.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from model.engine import (
    one_row,
    row_products,
    softmax,
)
from model.exact.lines import Lines
from model.exact.messages import (
    ClampedRows,
    ColumnMajor,
    Distributions,
    FactorizedGraph,
    Products,
    read_messages,
)
from model.types import FloatArray, IntArray


@dataclass(frozen=True)
class LevelInterpolation:
    """G_u of every level from three anchor levels: G_u = sum_s weights[u, s] G_{anchors[s]}.

    Exact (Lagrange interpolation of a quadratic) when the compatibility is the untruncated square
    C[u, v] = (L_u - L_v)^2; `of` returns None for any other compatibility.
    """

    anchors: np.ndarray  # (3,) level indices: the first, the middle and the last
    weights: np.ndarray  # (p, 3)

    @classmethod
    def of(cls, compat: np.ndarray) -> LevelInterpolation | None:
        """The interpolation for a compatibility matrix, if it is an untruncated square with p > 3."""
        p = len(compat)
        if p <= 3:
            return None
        x = np.sqrt(compat[:, 0])  # L_u - L_1 (the levels increase), if C is an untruncated square
        if not np.allclose(compat, (x[:, None] - x[None, :]) ** 2, rtol=1e-12, atol=0.0):
            return None
        anchors = np.array([0, p // 2, p - 1])
        nodes = x[anchors]
        weights = np.ones((p, 3))
        for s in range(3):
            for t in range(3):
                if t != s:
                    weights[:, s] *= (x - nodes[t]) / (nodes[s] - nodes[t])
        return cls(anchors, weights)

    def read(
        self, g_anchors: np.ndarray, a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray
    ) -> np.ndarray:
        """m[k, u] = a_{rows[k]}^T G_u b_{cols[k]} for all p levels from the anchors' G (3, D, D): (K, p)."""
        out: FloatArray = read_messages(g_anchors, a, b, rows, cols) @ self.weights.T
        return out


@dataclass(frozen=True)
class KnownField:
    """The converged messages of the known entries: what a query needs, precomputable per model version.

    g: (p, D, D) per-level aggregates of the known entries' compatibility-transformed distributions;
    h: (D, D) aggregate of ones (the normaliser); scale: the constant factor of the `scaled` mode;
    t: (N, p) the known entries' compatibility-transformed distributions, needed by the same-user and
    same-item terms (None when the kernel has none; `ClampedRows` for entries clamped to their labels);
    interp: set when the compatibility lets three levels' G determine the others (`LevelInterpolation`),
    so a query reads only g_anchors; columns: t in item order, for the column terms' one-user pass
    (`with_columns`).
    """

    g: np.ndarray
    h: np.ndarray
    scaling: str
    scale: float
    t: Distributions | None = None
    interp: LevelInterpolation | None = None
    columns: ColumnMajor | None = None
    g_anchors: np.ndarray | None = field(init=False, default=None, repr=False)
    _stacked: np.ndarray | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.interp is not None:
            object.__setattr__(self, "g_anchors", np.ascontiguousarray(self.g[self.interp.anchors]))

    def messages(
        self,
        a: FloatArray,
        b: FloatArray,
        rows: IntArray,
        cols: IntArray,
        lines: Lines | None = None,
        products: Products | None = None,
        similar: Callable[[int], FloatArray] | None = None,
    ) -> tuple[FloatArray, FloatArray | None]:
        """The messages of this field to the queries (rows[k], cols[k]) under its scaling (`sum` as is,
        `scaled` times `scale`, `normalized` divided by sum_l s(k, l): (K, p)), from the anchor levels when
        it has them; with active `lines`, the kernel's same-user and same-item terms over the known
        entries' transformed distributions `t` join both the messages and the normaliser, and the
        co-rating pseudo-count adds (lambda_r + lambda_c) c to the normaliser alone. For queries of one
        user, also the columns that `products` read after the field's (None for other queries, or when it
        read none): `products(vectors, cols)` reads b_{cols[k]} . vectors[u] for one user's queries, and
        may append more columns of the same pass over the item rows (`user_distributions`: the decoder's
        scores); `row_products` of b by default. `similar`: `Lines.messages`."""
        g = self.g if self.interp is None or self.g_anchors is None else self.g_anchors
        h, scaling, scale, t, interp, columns = (
            self.h,
            self.scaling,
            self.scale,
            self.t,
            self.interp,
            self.columns,
        )
        normalized = scaling == "normalized"
        if lines is not None and lines.active and t is None:
            raise ValueError("the kernel's line terms need the known entries' distributions")
        # The field's levels and the normaliser read the same (query, known) similarities, and for one user's
        # queries so does the same-user term (b_j . sum over the user's l of b_{j_l} t_l): one pass over the
        # queries' item embeddings for all of them (a whole-catalogue query reads the item table once).
        stacked = np.concatenate([g, h[None]]) if normalized else g
        row = one_row(rows)
        own = False  # whether the same-user term was read with the field
        probed: FloatArray | None = None
        if row is not None:
            vectors = np.matmul(a[row], stacked)  # (levels [+ total], D): forms[k] = b_{cols[k]} . vectors
            if lines is not None and lines.same_user > 0 and t is not None:
                # The same-user term is b_j . (lambda_u sum over the user's l of t_l b_{j_l}): read as part
                # of the field's vectors, it costs no column of its own. Under `interp` its levels follow
                # from the anchors' like the field's do (t is quadratic in L_u alike).
                sums = lines.user_sums(row, t, b, normalized)  # (p [+ total], D)
                if interp is not None:
                    sums = np.concatenate([sums[interp.anchors], sums[len(interp.weights) :]])
                vectors = vectors + lines.same_user * sums
                own = True
            read = products(vectors, cols) if products is not None else row_products(b, vectors, cols)
            forms = read[:, : len(vectors)]
            probed = read[:, len(vectors) :] if read.shape[1] > len(vectors) else None
        else:
            forms = read_messages(stacked, a, b, rows, cols)
        total: FloatArray | None = None
        msg = forms
        if normalized:
            msg, total = forms[:, :-1], forms[:, -1]
        if interp is not None:
            msg = msg @ interp.weights.T
        owned = False  # whether msg is a float64 array of this call's own (divided in place)
        if lines is not None and lines.active and t is not None:
            # `extra` is a new array of the line terms' (and with `normalized`, the normaliser's) sums: the
            # field's messages join it in place (a catalogue's (m, p) arrays are 1e6 numbers: each pass
            # counts).
            extra = lines.messages(t, a, b, rows, cols, normalized, columns, not own, similar)
            p = t.shape[1]
            for u in range(p):  # level by level: numpy's loops over rows of p numbers cost per row
                extra[:, u] += msg[:, u]
            msg, owned = extra[:, :p], True
            if normalized:
                assert total is not None
                denom = extra[:, p]
                denom += total
                denom += lines.prior_weight
                total = denom
        if scaling == "scaled":
            return msg * scale, probed
        if total is not None:
            norm = np.maximum(total, 1e-12)
            if owned:
                for u in range(msg.shape[1]):  # level by level, as above
                    msg[:, u] /= norm
                return msg, probed
            return msg / norm[:, None], probed
        return msg, probed

    def stacked(self, with_total: bool) -> FloatArray:
        """g, then h after it when `with_total`: (p [+ 1], D, D), made once per field."""
        if not with_total:
            return self.g
        if self._stacked is None:
            object.__setattr__(self, "_stacked", np.concatenate([self.g, self.h[None]]))
        out = self._stacked
        assert out is not None
        return out

    def with_columns(
        self,
        lines: Lines | None,
        labels: IntArray | None = None,
        compat: FloatArray | None = None,
        matrix: sp.csr_matrix | None = None,
    ) -> KnownField:
        """This field with `columns` set when the kernel has a column term (else as it is); `labels` and
        `compat` for known entries clamped to their labels (t = compat[labels]: `ColumnMajor.clamped`,
        from `matrix` when given)."""
        if self.t is None or lines is None or not lines.column_terms:
            return self
        if labels is not None and compat is not None:
            columns = ColumnMajor.clamped(lines.known, labels, compat, matrix)
            return dataclasses.replace(self, columns=columns)
        return dataclasses.replace(self, columns=ColumnMajor.of(self.t, lines.known))


def scaled_messages(
    g: np.ndarray,
    h: np.ndarray,
    scaling: str,
    scale: float,
    a: np.ndarray,
    b: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    lines: Lines | None = None,
    t: Distributions | None = None,
) -> np.ndarray:
    """`KnownField.messages` of the field (g, h, t) under a scaling, to (rows, cols): (K, p)."""
    msg, _ = KnownField(g=g, h=h, scaling=scaling, scale=scale, t=t).messages(a, b, rows, cols, lines)
    return msg


def known_field(
    a: np.ndarray,
    b: np.ndarray,
    known_rows: np.ndarray,
    known_cols: np.ndarray,
    known_probs: FloatArray | None,
    known_labels: IntArray,
    compat: np.ndarray,
    gamma: float,
    layers: int,
    scaling: str,
    scale: float,
    known: str,
    lines: Lines | None = None,
) -> KnownField:
    """Run the mean-field layers over all known entries and return their converged field.

    `predicted`: the known entries start from the base network's distributions and are updated T times
    with exact messages from every known entry. `clamped`: the known entries are fixed to their observed
    labels (a CRF conditioned on the observations), so no iteration is needed. `lines`: the kernel's
    same-user and same-item terms (none by default).
    """
    graph = FactorizedGraph(a, b, known_rows, known_cols)
    h = graph.total()
    if known == "clamped":
        q = np.zeros((len(known_labels), len(compat)))
        q[np.arange(len(known_labels)), known_labels] = 1.0
    else:
        if known_probs is None:
            raise ValueError("`predicted` known entries need the base network's distributions")
        q = known_probs
        unary = np.log(np.maximum(known_probs, 1e-30))
        for _ in range(layers):
            t = q @ compat.T
            g = graph.aggregate(t)
            msg = scaled_messages(g, h, scaling, scale, a, b, known_rows, known_cols, lines, t)
            q = softmax(unary - gamma * msg)
    t = q @ compat.T
    keep: Distributions | None = None
    if lines is not None and lines.active:
        keep = ClampedRows(known_labels, compat) if known == "clamped" else t
    interp = LevelInterpolation.of(compat)
    field = KnownField(g=graph.aggregate(t), h=h, scaling=scaling, scale=scale, t=keep, interp=interp)
    if known == "clamped":
        return field.with_columns(lines, known_labels, compat)
    return field.with_columns(lines)
