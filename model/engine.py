"""The base network in numpy: bilinear decoder, embeddings, similarities, and the ONNX branches.

Torch-free: the evaluator, the service and every scorer (model/paper.py, model/exact/) read the
network through `Network`. Shapes: n users, m items, d embedding size, p rating levels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model.config import ModelConfig
from model.types import Array, FloatArray, IntArray

if TYPE_CHECKING:
    from model.artifact import ArtifactFiles

FEW_USERS = 16
"""Up to this many distinct rows, per-row reads go row by row through matrix products."""


def last_axis(x: FloatArray, op: np.ufunc) -> FloatArray:
    """op reduced over the last axis, keeping it (..., 1). Rows of a few levels (a catalogue's entries)
    are reduced level by level over every row at once: numpy's reductions along a short last axis cost
    per row, twice as long (the same values to rounding)."""
    if x.ndim != 2 or x.shape[1] > 16:
        out: FloatArray = op.reduce(x, axis=-1, keepdims=True)
        return out
    acc: FloatArray = x[:, 0].copy()
    for u in range(1, x.shape[1]):
        op(acc, x[:, u], out=acc)
    kept: FloatArray = acc[:, None]
    return kept


def softmax(logits: FloatArray) -> FloatArray:
    """Softmax over the last axis."""
    e: FloatArray = np.exp(logits - last_axis(logits, np.maximum))
    e /= last_axis(e, np.add)
    return e


def softmax_inplace(logits: FloatArray) -> FloatArray:
    """`softmax`, written over `logits` (a new array of the caller's): no temporaries of its size."""
    logits -= last_axis(logits, np.maximum)
    np.exp(logits, out=logits)
    logits /= last_axis(logits, np.add)
    return logits


def log_softmax(logits: FloatArray) -> FloatArray:
    """log(softmax(logits)) over the last axis, without dividing and taking the log of every entry."""
    z: FloatArray = logits - last_axis(logits, np.maximum)
    z -= np.log(last_axis(np.exp(z), np.add))
    return z


def compatibility_matrix(levels: FloatArray, tau: float) -> FloatArray:
    """C[u, v] = min((L_u - L_v)^2, tau)."""
    diff = levels[:, None] - levels[None, :]
    return np.minimum(diff * diff, tau)


def normalize_rows(x: FloatArray) -> FloatArray:
    """Rows scaled to unit L2 norm (zero rows stay zero)."""
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    out: FloatArray = x / np.maximum(norm, 1e-12)
    return out


def lift(unit: FloatArray) -> FloatArray:
    """a = [1, u] / sqrt(2) for unit rows u, so that a . a' = (1 + u . u') / 2: (n, d) -> (n, d + 1)."""
    out: FloatArray = np.hstack([np.ones((len(unit), 1)), unit]) / np.sqrt(2.0)
    return out


def _embeddings(x: Array) -> FloatArray:
    """Embeddings as a `Network` holds them: float32 kept as they are (an artifact's shared maps), anything
    else as float64."""
    x = np.asarray(x)
    out: FloatArray = x if x.dtype == np.float32 else x.astype(np.float64, copy=False)
    return out


def _norms_lifted(rows: Array) -> tuple[FloatArray, FloatArray]:
    """Embedding rows' norms and lifted unit rows (float64), each row on its own: the same numbers for a
    row whether computed with the whole table or alone (`Network.with_rows`)."""
    x = np.asarray(rows, dtype=np.float64)
    norms = np.maximum(np.linalg.norm(x, axis=1), 1e-12)
    return norms, lift(x / norms[:, None])  # normalize_rows, the same


def _catalogue_scale(item_norms: FloatArray) -> np.ndarray:
    """(m,) float32 1 / (sqrt(2) |e_j|): what the whole-catalogue products scale the float32 item rows by."""
    out: np.ndarray = np.float32(1.0 / np.sqrt(2.0)) / item_norms.astype(np.float32)
    return out


def unlift(lifted: FloatArray) -> FloatArray:
    """The unit rows u of lifted rows a = [1, u] / sqrt(2): (n, d + 1) -> (n, d)."""
    out: FloatArray = lifted[:, 1:] * np.sqrt(2.0)
    return out


def bilinear_forms(left: FloatArray, mats: FloatArray, rows: IntArray, right: FloatArray) -> FloatArray:
    """out[k, u] = left[rows[k]]^T mats[u] right[k]: (K, p), with left^T mats[u] formed once per distinct
    row. Up to FEW_USERS distinct rows (a request) one matrix product per row, else one batched einsum."""
    if len(rows) and (rows == rows[0]).all():  # one user's queries (a request): no unique, no masks
        single: FloatArray = right @ np.matmul(left[rows[0]], mats).T  # (K, D) @ (D, p)
        return single
    users, inverse = np.unique(rows, return_inverse=True)
    if len(users) <= FEW_USERS:  # no (K, p, D) gather
        lm = np.matmul(left[users][None], mats)  # (p, distinct rows, D)
        out = np.empty((len(rows), mats.shape[0]))
        for i in range(len(users)):
            mine = inverse == i
            out[mine] = right[mine] @ lm[:, i, :].T
        return out
    lm = np.einsum("id,ude->iue", left[users], mats)  # (distinct rows, p, D)
    res: FloatArray = np.einsum("kue,ke->ku", lm[inverse], right)
    return res


def one_row(rows: IntArray) -> int | None:
    """The row all of `rows` share (a request's user), or None."""
    if len(rows) and rows[0] == rows[-1] and (rows == rows[0]).all():
        return int(rows[0])
    return None


def in_order(cols: IntArray, size: int) -> bool:
    """Whether `cols` is 0, 1, ..., size - 1: a whole catalogue in order, whose arrays need no gather."""
    return len(cols) == size and (size == 0 or (cols[0] == 0 and bool((np.diff(cols) == 1).all())))


def row_products(table: FloatArray, vectors: FloatArray, cols: IntArray) -> FloatArray:
    """out[k, u] = table[cols[k]] . vectors[u]: (K, q). When most of the table is asked for (a top-N over
    the catalogue) the whole table is read in one product and the answers gathered, instead of gathering
    most of its rows first."""
    if 4 * len(cols) > len(table):
        if table.dtype == vectors.dtype:
            whole: FloatArray = (table @ vectors.T)[cols]
            return whole
        # A float32 table (`Network`) read in float64 chunk by chunk: no whole float64 copy of it.
        whole = np.empty((len(table), len(vectors)))
        for lo in range(0, len(table), ROW_CHUNK):
            whole[lo : lo + ROW_CHUNK] = np.asarray(table[lo : lo + ROW_CHUNK], dtype=np.float64) @ vectors.T
        return whole[cols]
    out: FloatArray = np.take(table, cols, axis=0) @ vectors.T
    return out


ROW_CHUNK = 8192
"""Rows of a float32 table that `row_products` converts to float64 at a time."""


def catalogue_products(
    network: Network, vectors: FloatArray, cols: IntArray, raw: FloatArray | None = None
) -> FloatArray:
    """out[k, u] = b_{cols[k]} . vectors[u] for the lifted item rows b_j = [1, unit_j] / sqrt(2) (the
    exact CRF's item side, model/exact/): (K, q), followed by e_{cols[k]} . raw[r] for the item
    embeddings themselves (the decoder's scores): (K, q + r), float64, in Fortran order (each column
    contiguous). One product over the float32 item table
    (`Network.catalogue`: half the bytes of the float64 rows, and a map shared by the workers), with
    b_j . v = (v_0 + (e_j . v_1:) / |e_j|) / sqrt(2): what a top-N over the catalogue reads. Float32
    arithmetic: about 1e-6 of each product's size."""
    table = network.catalogue
    q = len(vectors)
    v = np.asarray(vectors[:, 1:] if raw is None else np.vstack([vectors[:, 1:], raw]), dtype=np.float32)
    # Level-major: (q + r, m), each column of the answer contiguous (returned as its transpose, Fortran
    # order): what reads the products reads them column by column, and numpy's loops over rows of q + r
    # numbers cost several times more.
    whole: np.ndarray = v @ table.T
    offsets = np.asarray(vectors[:, 0], dtype=np.float32) * np.float32(1.0 / np.sqrt(2.0))
    for u in range(q):
        column = whole[u]
        column *= network.catalogue_scale
        column += offsets[u]
    # In float64 from here on: what reads the products adds float64 terms to them, and numpy's loops that
    # cast as they go cost several times a cast done once.
    picked = whole if in_order(cols, len(table)) else whole[:, cols]  # the catalogue in order: no gather
    out: np.ndarray = picked.astype(np.float64).T
    return out


def row_forms(left: FloatArray, mats: FloatArray, row: int, table: FloatArray, cols: IntArray) -> FloatArray:
    """out[k, u] = left[row]^T mats[u] table[cols[k]] for one row: (K, p) (`row_products`)."""
    return row_products(table, np.matmul(left[row], mats), cols)


def label_probabilities(
    user_emb: FloatArray, item_emb: FloatArray, bilinear: FloatArray, rows: IntArray, cols: IntArray
) -> FloatArray:
    """P(M_ij = L_u) for the entries (rows[k], cols[k]): (K, p)."""
    row = one_row(rows)
    if row is not None:
        return softmax(row_forms(user_emb, bilinear, row, item_emb, cols))
    out = np.empty((len(rows), bilinear.shape[0]), dtype=np.float64)
    step = 8192  # bounds the (chunk, p, d) temporary
    for start in range(0, len(rows), step):
        r, c = rows[start : start + step], cols[start : start + step]
        # u^T B_p once per distinct user (many entries share one: a user's queries, a test split's rows).
        scores = bilinear_forms(user_emb, bilinear, r, item_emb[c])  # (k, p)
        out[start : start + step] = softmax(scores)
    return out


def nearest_level(values: FloatArray, levels: FloatArray) -> IntArray:
    """Index of the rating level nearest to each value: (K,) int64."""
    idx = np.clip(np.searchsorted(levels, values), 1, len(levels) - 1)
    return np.where(values - levels[idx - 1] <= levels[idx] - values, idx - 1, idx).astype(np.int64)


def expected_rating(probs: FloatArray, levels: FloatArray) -> FloatArray:
    """R* = sum_u L_u P_u: (K,)."""
    out: FloatArray = probs @ levels
    return out


@dataclass(frozen=True, eq=False)
class Network:
    """The base network's arrays, as an artifact stores them (float32 on disk).

    Float32 embeddings (an artifact's read-only maps, which the workers of a machine share) are kept as they
    are, not copied to float64: every product reads them cast to float64 (numpy's promotion), the same
    numbers as a float64 copy would give, since a float32 converts exactly. What derives from them is
    float64 and held once: the lifted unit rows a_i = [1, u_i] / sqrt(2) (a_i . a_i' is the scaled cosine,
    which the similarities and the exact CRF read) and the item norms; the unit rows themselves are made
    from the lifted ones where a whole table of them is needed (`user_unit`, `item_unit`)."""

    config: ModelConfig
    user_emb: FloatArray  # (n, d) float32 or float64
    item_emb: FloatArray  # (m, d) float32 or float64
    bilinear: FloatArray  # (p, d, d) float64
    item_table: np.ndarray | None = field(default=None, repr=False)
    """(m, d) float32: the item embeddings that whole-catalogue products read (`catalogue_products`):
    item_emb itself when it is float32, else made from it on first use (`catalogue`)."""
    levels: FloatArray = field(init=False, repr=False)  # (p,)
    user_lifted: FloatArray = field(init=False, repr=False)  # (n, d + 1): s_r(i, i') = a_i . a_i'
    item_lifted: FloatArray = field(init=False, repr=False)  # (m, d + 1): s_c(j, j') = b_j . b_j'
    item_norms: FloatArray = field(init=False, repr=False)  # (m,): item_emb = item_norms * item_unit
    user_norms: FloatArray = field(init=False, repr=False)  # (n,): user_emb = user_norms * user_unit
    catalogue_scale: np.ndarray = field(init=False, repr=False)  # (m,) float32: 1 / (sqrt(2) |e_j|)

    def __post_init__(self) -> None:
        for name in ("user_emb", "item_emb"):
            object.__setattr__(self, name, _embeddings(getattr(self, name)))
        if self.item_table is None and self.item_emb.dtype == np.float32:
            object.__setattr__(self, "item_table", self.item_emb)
        object.__setattr__(self, "bilinear", np.asarray(self.bilinear, dtype=np.float64))
        object.__setattr__(self, "levels", np.asarray(self.config.levels, dtype=np.float64))
        for side in ("user", "item"):
            norms, lifted = _norms_lifted(getattr(self, f"{side}_emb"))
            object.__setattr__(self, f"{side}_norms", norms)
            object.__setattr__(self, f"{side}_lifted", lifted)
        object.__setattr__(self, "catalogue_scale", _catalogue_scale(self.item_norms))

    def with_rows(
        self,
        user_emb: FloatArray,
        item_emb: FloatArray,
        users: IntArray,
        items: IntArray,
        item_table: np.ndarray | None = None,
    ) -> Network:
        """A network of the same config and decoder with these embeddings, which differ from this one's on
        the rows `users` and `items` alone and may have rows appended: what derives from them is copied
        and computed for those rows and the appended ones only (an online batch's cost, not the whole
        tables'), the same numbers as `Network(...)` of them."""
        out = Network.__new__(Network)
        derived: dict[str, Any] = {"config": self.config, "bilinear": self.bilinear, "levels": self.levels}
        arrays = {"user_emb": _embeddings(user_emb), "item_emb": _embeddings(item_emb)}
        if item_table is None and arrays["item_emb"].dtype == np.float32:
            item_table = arrays["item_emb"]
        derived.update(arrays, item_table=item_table)
        for side, emb, changed in (("user", user_emb, users), ("item", item_emb, items)):
            old_norms, old_lifted = getattr(self, f"{side}_norms"), getattr(self, f"{side}_lifted")
            n_old, n = len(old_norms), len(emb)
            if n < n_old:
                raise ValueError(f"the {side} embeddings can only grow")
            changed = np.asarray(changed, dtype=np.int64)
            redo = np.union1d(changed[changed < n_old], np.arange(n_old, n))
            norms = np.empty(n)
            norms[:n_old] = old_norms
            lifted = np.empty((n, old_lifted.shape[1]))
            lifted[:n_old] = old_lifted
            norms[redo], lifted[redo] = _norms_lifted(emb[redo])
            derived[f"{side}_norms"], derived[f"{side}_lifted"] = norms, lifted
        derived["catalogue_scale"] = _catalogue_scale(derived["item_norms"])
        for name, value in derived.items():
            object.__setattr__(out, name, value)
        return out

    def user_similarities(self, user: int) -> FloatArray:
        """s_r(user, i) = (1 + cos(u_user, u_i)) / 2 for every user i: (n,) float64, from one product over
        the user embeddings as stored (float32 maps: half the bytes of the lifted rows; to about 1e-7)."""
        dots = self.user_emb @ self.user_emb[user]
        out: FloatArray = 0.5 + 0.5 * (dots / (self.user_norms * self.user_norms[user]))
        return out

    @property
    def user_unit(self) -> FloatArray:
        """(n, d) unit rows of the user embeddings, made from the lifted rows (a new array each time)."""
        return unlift(self.user_lifted)

    @property
    def item_unit(self) -> FloatArray:
        """(m, d) unit rows of the item embeddings, made from the lifted rows (a new array each time)."""
        return unlift(self.item_lifted)

    @property
    def catalogue(self) -> np.ndarray:
        """`item_table`, made from the embeddings when none was given."""
        if self.item_table is None:
            object.__setattr__(self, "item_table", self.item_emb.astype(np.float32))
        assert self.item_table is not None
        return self.item_table

    @property
    def n_users(self) -> int:
        """Rows n of the rating matrix."""
        return len(self.user_emb)

    @property
    def n_items(self) -> int:
        """Columns m of the rating matrix."""
        return len(self.item_emb)

    def probabilities(self, rows: IntArray, cols: IntArray) -> FloatArray:
        """Base-network probabilities of the entries (rows[k], cols[k]): (K, p)."""
        return label_probabilities(self.user_emb, self.item_emb, self.bilinear, rows, cols)

    def entry_similarity(self, rows: IntArray, cols: IntArray) -> FloatArray:
        """s(k, l) = s_r(i_k, i_l) s_c(j_k, j_l) with scaled cosines: (K, K)."""
        a, b = self.user_lifted[rows], self.item_lifted[cols]
        out: FloatArray = (a @ a.T) * (b @ b.T)
        return out


class OnnxNetwork:
    """The exported base network run by ONNX Runtime: row branch, column branch and decoder."""

    FILES = ("row_branch.onnx", "col_branch.onnx", "decoder.onnx")

    def __init__(self, source: str | Path | ArtifactFiles, threads: int = 1) -> None:
        """`source`: a loaded artifact's checked files (`Artifact.files`: only files its manifest lists
        are opened), or a directory (the exporter's own, while it writes one)."""
        import onnxruntime as ort  # imported here so pure-numpy users of this module do not need it

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if isinstance(source, str | Path):
            row, col, decoder = (Path(source) / name for name in self.FILES)
        else:
            row, col, decoder = (source.path(name) for name in self.FILES)
        self.row = ort.InferenceSession(str(row), opts, providers=providers)
        self.col = ort.InferenceSession(str(col), opts, providers=providers)
        self.decoder = ort.InferenceSession(str(decoder), opts, providers=providers)

    def _run(self, session: Any, feeds: dict[str, Array]) -> Array:
        out: Array = session.run(None, feeds)[0]
        return out

    def embed_users(self, rating_rows: Array) -> Array:
        """User embeddings from dense rating rows: (b, m) -> (b, d) float32."""
        return self._run(self.row, {"ratings": rating_rows.astype(np.float32)})

    def embed_items(self, rating_cols: Array) -> Array:
        """Item embeddings from dense rating columns: (b, n) -> (b, d) float32."""
        return self._run(self.col, {"ratings": rating_cols.astype(np.float32)})

    def probabilities(self, user_emb: Array, item_emb: Array) -> Array:
        """Label probabilities of paired embeddings: (K, d), (K, d) -> (K, p) float32."""
        feeds = {"user": user_emb.astype(np.float32), "item": item_emb.astype(np.float32)}
        return self._run(self.decoder, feeds)


def mean_field(
    probs: FloatArray, sim: FloatArray, compat: FloatArray, gamma: float, layers: int
) -> FloatArray:
    """T mean-field iterations: Q <- softmax(-(Phi + gamma S (Q C^T))), Phi = -ln P. Returns (K, p).

    Also runs a batch of independent CRFs at once: probs (B, K, p), sim (B, K, K).
    """
    unary = -np.log(np.maximum(probs, 1e-30))  # (K, p)
    q = probs
    for _ in range(layers):
        messages = sim @ (q @ compat.T)  # (K, p)
        q = softmax(-(unary + gamma * messages))
    return q
