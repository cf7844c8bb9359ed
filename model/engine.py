"""Torch-free DCMC scoring: bilinear decoder, similarities, mean-field and the test-time procedure.

The offline evaluator and the online service both call `predict_entries`, so for the same inputs and
seed they return the same numbers. Shapes: n users, m items, d embedding size, p rating levels.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model import exact
from model.config import InferenceConfig, ModelConfig
from model.exact import softmax


def compatibility_matrix(levels: np.ndarray, tau: float) -> np.ndarray:
    """C[u, v] = min((L_u - L_v)^2, tau)."""
    diff = levels[:, None] - levels[None, :]
    return np.minimum(diff * diff, tau)


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (zero rows stay zero)."""
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norm, 1e-12)


def label_probabilities(
    user_emb: np.ndarray, item_emb: np.ndarray, bilinear: np.ndarray, rows: np.ndarray, cols: np.ndarray
) -> np.ndarray:
    """P(M_ij = L_u) for the entries (rows[k], cols[k]): (K, p)."""
    out = np.empty((len(rows), bilinear.shape[0]), dtype=np.float64)
    step = 8192  # bounds the (chunk, p, d) temporary
    for start in range(0, len(rows), step):
        r, c = rows[start : start + step], cols[start : start + step]
        # u^T B_p once per distinct user (many entries share one: a user's queries, a test split's rows).
        scores = exact.bilinear_forms(user_emb, bilinear, r, item_emb[c])  # (k, p)
        out[start : start + step] = softmax(scores)
    return out


def mean_field(
    probs: np.ndarray, sim: np.ndarray, compat: np.ndarray, gamma: float, layers: int
) -> np.ndarray:
    """T mean-field iterations: Q <- softmax(-(Phi + gamma S (Q C^T))), Phi = -ln P. Returns (K, p).

    Also runs a batch of independent CRFs at once: probs (B, K, p), sim (B, K, K).
    """
    unary = -np.log(np.maximum(probs, 1e-30))  # (K, p)
    q = probs
    for _ in range(layers):
        messages = sim @ (q @ compat.T)  # (K, p)
        q = softmax(-(unary + gamma * messages))
    return q


FieldKey = tuple[str, str, float, int, float, float, float, float, float, float, float, float, float]


@dataclass
class ScoringModel:
    """What test-time inference needs: embeddings, decoder weights and the known ratings."""

    config: ModelConfig
    user_emb: np.ndarray  # (n, d) float64
    item_emb: np.ndarray  # (m, d) float64
    bilinear: np.ndarray  # (p, d, d) float64
    known_rows: np.ndarray  # (N,) int64
    known_cols: np.ndarray  # (N,) int64
    known_values: np.ndarray | None = None  # (N,) float64; needed by `exact` with clamped known entries

    def __post_init__(self) -> None:
        self.levels = np.asarray(self.config.levels, dtype=np.float64)
        self.compat = compatibility_matrix(self.levels, self.config.tau)
        self.user_unit = normalize_rows(self.user_emb)
        self.item_unit = normalize_rows(self.item_emb)
        self._known_probs: np.ndarray | None = None
        self._partitions: dict[tuple[int, int, int, int], Partitions] = {}
        self._fields: dict[FieldKey, exact.KnownField] = {}
        self._line_index: tuple[exact.LineIndex, exact.LineIndex] | None = None
        self._affinity: dict[tuple[str, float, float], np.ndarray] = {}  # by (what, q, shrink)
        self._biases: dict[tuple[float, float], tuple[float, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()
        self.user_lifted = exact.lift(self.user_unit)  # a_i = [1, u_i] / sqrt(2): s_r = a_i . a_i'
        self.item_lifted = exact.lift(self.item_unit)

    @property
    def known_probs(self) -> np.ndarray:
        """Base-network probabilities of every known entry, computed once: (N, p)."""
        if self._known_probs is None:
            self._known_probs = label_probabilities(
                self.user_emb, self.item_emb, self.bilinear, self.known_rows, self.known_cols
            )
        return self._known_probs

    def partitions(self, inference: InferenceConfig) -> Partitions:
        """The random partitions of `inference` with their precomputed tables (drawn once, then cached)."""
        key = (inference.seed, inference.repeats, inference.subset_rows, inference.subset_cols)
        with self._lock:
            if key not in self._partitions:
                self.known_probs  # noqa: B018 - computed under the lock, once
                self._partitions[key] = draw_partitions(self, inference)
            return self._partitions[key]

    def gamma(self, inference: InferenceConfig) -> float:
        """The pairwise weight in force: the inference override, else the model's."""
        return self.config.gamma if inference.gamma is None else inference.gamma

    def tau(self, inference: InferenceConfig) -> float:
        """The compatibility's truncation in force for `exact`: the inference override, else the model's."""
        return self.config.tau if inference.tau is None else inference.tau

    def field_key(self, inference: InferenceConfig) -> FieldKey:
        """What a known field depends on beyond the model:
        (scaling, known, gamma, T, scale, tau, same_user, same_item, co_rating, co_rating_power,
        co_rating_prior, co_rating_user, co_rating_shrink)."""
        scale = inference.subset_rows * inference.subset_cols / (len(self.user_emb) * len(self.item_emb))
        gamma, tau = self.gamma(inference), self.tau(inference)
        co_rated = inference.co_rating > 0 or inference.co_rating_user > 0
        return (
            inference.scaling,
            inference.known,
            gamma,
            self.config.mf_layers,
            scale,
            tau,
            inference.same_user,
            inference.same_item,
            inference.co_rating,
            inference.co_rating_power if co_rated else 0.0,
            inference.co_rating_prior if co_rated else 0.0,
            inference.co_rating_user,
            inference.co_rating_shrink if co_rated else 0.0,
        )

    def lines(self, inference: InferenceConfig) -> exact.Lines | None:
        """The kernel's same-user, same-item and co-rating terms of an `exact` setting (None when every
        weight is 0); the known entries are indexed by row and column, and the co-rating tables are built,
        once."""
        terms = (inference.same_user, inference.same_item, inference.co_rating, inference.co_rating_user)
        if not any(terms):
            return None
        with self._lock:
            if self._line_index is None:
                self._line_index = (
                    exact.LineIndex(self.known_rows, len(self.user_emb)),
                    exact.LineIndex(self.known_cols, len(self.item_emb)),
                )
            table = (inference.co_rating_power, inference.co_rating_shrink)
            items = self._co_rating_table("items", *table) if inference.co_rating > 0 else None
            users = self._co_rating_table("users", *table) if inference.co_rating_user > 0 else None
        by_row, by_col = self._line_index
        return exact.Lines(
            inference.same_user,
            inference.same_item,
            self.known_rows,
            self.known_cols,
            by_row,
            by_col,
            inference.co_rating,
            items,
            inference.co_rating_prior,
            inference.co_rating_user,
            users,
        )

    def _co_rating_table(self, what: str, power: float, shrink: float) -> np.ndarray:
        """The item (m x m) or user (n x n) co-rating table of an exponent and shrinkage, built once (the
        caller holds the lock)."""
        key = (what, power, shrink)
        if key not in self._affinity:
            if self.known_values is None:
                raise ValueError("the co-rating terms need the known ratings' values")
            n, m = len(self.user_emb), len(self.item_emb)
            r, c, v = self.known_rows, self.known_cols, self.known_values
            self._affinity[key] = (
                exact.co_rating_affinity(r, c, v, n, m, power, shrink)
                if what == "items"
                else exact.co_rating_affinity(c, r, v, m, n, power, shrink, what="users")
            )
        return self._affinity[key]

    def biases(self, inference: InferenceConfig) -> tuple[float, np.ndarray, np.ndarray]:
        """The bias baseline (mu, user biases, item biases) of the known ratings under the setting's
        penalties, fitted once per pair of penalties."""
        key = (inference.baseline_user_shrink, inference.baseline_item_shrink)
        with self._lock:
            if key not in self._biases:
                if self.known_values is None:
                    raise ValueError("the bias baseline needs the known ratings' values")
                self._biases[key] = exact.bias_baseline(
                    self.known_rows,
                    self.known_cols,
                    self.known_values,
                    len(self.user_emb),
                    len(self.item_emb),
                    *key,
                )
            return self._biases[key]

    def add_field(self, key: FieldKey, field: exact.KnownField) -> None:
        """Install a precomputed known field (e.g. from the artifact) under its key."""
        with self._lock:
            self._fields[key] = field

    def has_field(self, inference: InferenceConfig) -> bool:
        """Whether the known field of `inference` is already computed (or was loaded)."""
        with self._lock:
            return self.field_key(inference) in self._fields

    def known_field(self, inference: InferenceConfig) -> exact.KnownField:
        """The converged field of all known entries for an `exact` setting (computed once, then cached)."""
        key = self.field_key(inference)
        _, _, gamma, _, scale, tau, *_ = key
        lines = self.lines(inference)
        with self._lock:
            if key not in self._fields:
                if inference.known == "clamped" and self.known_values is None:
                    raise ValueError("clamped known entries need the known ratings' values")
                labels = (
                    nearest_level(self.known_values, self.levels)
                    if self.known_values is not None
                    else np.zeros(len(self.known_rows), dtype=np.int64)
                )
                self._fields[key] = exact.known_field(
                    self.user_lifted,
                    self.item_lifted,
                    self.known_rows,
                    self.known_cols,
                    self.known_probs,
                    labels,
                    compatibility_matrix(self.levels, tau),
                    gamma,
                    self.config.mf_layers,
                    inference.scaling,
                    scale,
                    inference.known,
                    lines,
                )
            return self._fields[key]

    def probabilities(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Base-network probabilities of arbitrary entries: (K, p)."""
        return label_probabilities(self.user_emb, self.item_emb, self.bilinear, rows, cols)

    def entry_similarity(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """s(k, l) = s_r(i_k, i_l) s_c(j_k, j_l) with scaled cosines: (K, K)."""
        u = self.user_unit[rows]
        v = self.item_unit[cols]
        return ((1.0 + u @ u.T) / 2.0) * ((1.0 + v @ v.T) / 2.0)


@dataclass(frozen=True)
class Partitions:
    """The R random row x column partitions of one inference setting, drawn once from its seed.

    The draws are those of `np.random.default_rng(seed)`: per repeat a permutation of the rows, then one of
    the columns; group g holds the permuted positions [g * subset, (g + 1) * subset). Everything that depends
    only on the model and the partitions (known entries sorted by block, scaled-cosine Gram matrices of every
    row and column group) is computed here once, so a request pays only for the blocks it touches.
    """

    subset_rows: int
    subset_cols: int
    n_col_groups: int
    row_group: np.ndarray  # (R, n) group of each row
    col_group: np.ndarray  # (R, m)
    row_local: np.ndarray  # (R, n) position of each row inside its group
    col_local: np.ndarray  # (R, m)
    known_order: np.ndarray  # (R, N) known entries sorted by block (stable: ties keep entry order)
    known_sorted: np.ndarray  # (R, N) their block ids
    row_gram: np.ndarray  # (R, row groups * subset_rows^2) s_r within each row group, flattened
    col_gram: np.ndarray  # (R, col groups * subset_cols^2) s_c within each column group, flattened

    @property
    def repeats(self) -> int:
        """Number R of partitions."""
        return len(self.row_group)


def _group_grams(unit: np.ndarray, perm: np.ndarray, subset: int) -> np.ndarray:
    """Scaled cosines (1 + cos) / 2 of the members of each group, flattened: (groups * subset^2,)."""
    groups = -(-len(perm) // subset)
    members = np.zeros((groups * subset, unit.shape[1]))
    members[: len(perm)] = unit[perm]
    members = members.reshape(groups, subset, -1)  # (groups, subset, d)
    return ((1.0 + members @ members.transpose(0, 2, 1)) / 2.0).ravel()


def draw_partitions(model: ScoringModel, inference: InferenceConfig) -> Partitions:
    """Draw the `inference.repeats` partitions of `inference.seed` and precompute their per-model tables."""
    n, m = len(model.user_emb), len(model.item_emb)
    rng = np.random.default_rng(inference.seed)
    sr, sc = inference.subset_rows, inference.subset_cols
    n_col_groups = -(-m // sc)
    fields: dict[str, list[np.ndarray]] = {k: [] for k in ("rg", "cg", "rl", "cl", "ko", "ks", "rgm", "cgm")}
    for _ in range(inference.repeats):
        row_perm, col_perm = rng.permutation(n), rng.permutation(m)
        rank_r, rank_c = np.empty(n, dtype=np.int64), np.empty(m, dtype=np.int64)
        rank_r[row_perm], rank_c[col_perm] = np.arange(n), np.arange(m)
        row_group, col_group = rank_r // sr, rank_c // sc
        known_block = row_group[model.known_rows] * n_col_groups + col_group[model.known_cols]
        order = np.argsort(known_block, kind="stable")
        fields["rg"].append(row_group)
        fields["cg"].append(col_group)
        fields["rl"].append(rank_r % sr)
        fields["cl"].append(rank_c % sc)
        fields["ko"].append(order)
        fields["ks"].append(known_block[order])
        fields["rgm"].append(_group_grams(model.user_unit, row_perm, sr))
        fields["cgm"].append(_group_grams(model.item_unit, col_perm, sc))
    stack = {k: np.stack(v) for k, v in fields.items()}
    return Partitions(
        subset_rows=sr,
        subset_cols=sc,
        n_col_groups=n_col_groups,
        row_group=stack["rg"],
        col_group=stack["cg"],
        row_local=stack["rl"],
        col_local=stack["cl"],
        known_order=stack["ko"],
        known_sorted=stack["ks"],
        row_gram=stack["rgm"],
        col_gram=stack["cgm"],
    )


def predict_entries(
    model: ScoringModel,
    rows: np.ndarray,
    cols: np.ndarray,
    inference: InferenceConfig,
    *,
    query_probs: np.ndarray | None = None,
) -> np.ndarray:
    """Final label distributions of the queried entries (rows[k], cols[k]): (K, p).

    `none`: the base network's probabilities. `paper`: rows and columns are split at random into
    subsets; in each block (row subset x column subset) that holds a query, a CRF over the block's
    known entries and its queried entries runs the mean-field layers; the distributions from
    `inference.repeats` random partitions are averaged. `exact`: the mean-field layers run over every
    known entry with exact factorised messages (see model/exact.py) and each query receives the messages
    of all known entries; with `inference.baseline` = w > 0 its distribution is then mixed with the bias
    baseline's, (1 - w) Q + w B. `query_probs` (K, p) replaces the base-network
    probabilities of the queries (the service computes them from its cached embeddings).
    """
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    if query_probs is None:
        query_probs = model.probabilities(rows, cols)
    if inference.mode == "none" or model.config.mf_layers == 0 or len(rows) == 0:
        return query_probs
    if inference.mode == "exact":
        field = model.known_field(inference)
        dist = exact.query_distributions(
            field,
            model.user_lifted,
            model.item_lifted,
            rows,
            cols,
            query_probs,
            model.gamma(inference),
            model.lines(inference),
        )
        if inference.baseline == 0:
            return dist
        mu, user_bias, item_bias = model.biases(inference)
        baseline = mu + user_bias[rows] + item_bias[cols]
        return exact.baseline_mixture(dist, baseline, model.levels, inference.baseline)
    parts = model.partitions(inference)
    # Every block that holds a query, over all repeats: (repeat, first known, known count, queries).
    rep_l, block_l, lo_l, hi_l, qorder_l, qcount_l = [], [], [], [], [], []
    for r in range(parts.repeats):
        query_block = parts.row_group[r, rows] * parts.n_col_groups + parts.col_group[r, cols]
        query_order = np.argsort(query_block, kind="stable")
        blocks, counts = np.unique(query_block[query_order], return_counts=True)
        rep_l.append(np.full(len(blocks), r))
        block_l.append(blocks)
        lo_l.append(np.searchsorted(parts.known_sorted[r], blocks, side="left"))
        hi_l.append(np.searchsorted(parts.known_sorted[r], blocks, side="right"))
        qorder_l.append(query_order)
        qcount_l.append(counts)
    rep, block = np.concatenate(rep_l), np.concatenate(block_l)
    lo, n_known = np.concatenate(lo_l), np.concatenate(hi_l) - np.concatenate(lo_l)
    n_query = np.concatenate(qcount_l)
    query_order = np.concatenate(qorder_l)
    query_start = np.cumsum(n_query) - n_query
    total = np.zeros_like(query_probs)
    # Blocks are independent CRFs: run them in padded batches of bounded size.
    sizes = n_known + n_query
    order = np.argsort(sizes, kind="stable")
    budget = 1 << 21  # padded similarity entries per batch
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * int(sizes[order[stop]]) ** 2 <= budget:
            stop += 1
        chosen = order[start:stop]
        _run_blocks(
            model,
            parts,
            inference,
            rows,
            cols,
            query_probs,
            total,
            rep[chosen],
            block[chosen],
            lo[chosen],
            n_known[chosen],
            query_start[chosen],
            n_query[chosen],
            query_order,
        )
        start = stop
    return total / inference.repeats


def _run_blocks(
    model: ScoringModel,
    parts: Partitions,
    inference: InferenceConfig,
    rows: np.ndarray,
    cols: np.ndarray,
    query_probs: np.ndarray,
    total: np.ndarray,
    rep: np.ndarray,
    block: np.ndarray,
    lo: np.ndarray,
    n_known: np.ndarray,
    query_start: np.ndarray,
    n_query: np.ndarray,
    query_order: np.ndarray,
) -> None:
    """Mean-field over a batch of blocks, padded to the largest; adds the queries' results to `total`."""
    n_blocks, p = len(rep), query_probs.shape[1]
    width = int((n_known + n_query).max())
    # Node slots: known entries first, then the block's queries, then padding.
    kb, kpos = exact.ranges(lo, n_known)
    known = parts.known_order[rep[kb], kpos]
    kslot = kpos - lo[kb]
    qb, qpos = exact.ranges(query_start, n_query)
    queries = query_order[qpos]
    qslot = n_known[qb] + qpos - query_start[qb]
    node_rows = np.zeros((n_blocks, width), dtype=np.int64)
    node_cols = np.zeros((n_blocks, width), dtype=np.int64)
    probs = np.full((n_blocks, width, p), 1.0 / p)
    mask = np.zeros((n_blocks, width))
    node_rows[kb, kslot], node_cols[kb, kslot] = model.known_rows[known], model.known_cols[known]
    node_rows[qb, qslot], node_cols[qb, qslot] = rows[queries], cols[queries]
    probs[kb, kslot], probs[qb, qslot] = model.known_probs[known], query_probs[queries]
    mask[kb, kslot] = mask[qb, qslot] = 1.0
    # s(k, l) = s_r(i_k, i_l) s_c(j_k, j_l), looked up in the precomputed Gram matrices of the groups.
    sr, sc = parts.subset_rows, parts.subset_cols
    rep_col = rep[:, None]
    rl = parts.row_local[rep_col, node_rows]  # (B, W)
    cl = parts.col_local[rep_col, node_cols]
    row_base = (rep * parts.row_gram.shape[1] + (block // parts.n_col_groups) * sr * sr)[:, None, None]
    col_base = (rep * parts.col_gram.shape[1] + (block % parts.n_col_groups) * sc * sc)[:, None, None]
    sim = np.take(parts.row_gram, row_base + rl[:, :, None] * sr + rl[:, None, :])
    sim *= np.take(parts.col_gram, col_base + cl[:, :, None] * sc + cl[:, None, :])
    sim *= mask[:, None, :]  # padding sends no messages
    if model.config.message_scaling == "normalized":
        sim /= np.maximum(sim.sum(axis=2, keepdims=True), 1e-12)
    final = mean_field(probs, sim, model.compat, model.config.gamma, model.config.mf_layers)
    np.add.at(total, queries, final[qb, qslot])


def nearest_level(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Index of the rating level nearest to each value: (K,) int64."""
    idx = np.clip(np.searchsorted(levels, values), 1, len(levels) - 1)
    return np.where(values - levels[idx - 1] <= levels[idx] - values, idx - 1, idx).astype(np.int64)


def expected_rating(probs: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """R* = sum_u L_u P_u: (K,)."""
    return probs @ levels


class OnnxNetwork:
    """The exported base network run by ONNX Runtime: row branch, column branch and decoder."""

    FILES = ("row_branch.onnx", "col_branch.onnx", "decoder.onnx")

    def __init__(self, directory: str | Path, threads: int = 1) -> None:
        import onnxruntime as ort  # imported here so pure-numpy users of this module do not need it

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        directory = Path(directory)
        self.row = ort.InferenceSession(str(directory / self.FILES[0]), opts, providers=providers)
        self.col = ort.InferenceSession(str(directory / self.FILES[1]), opts, providers=providers)
        self.decoder = ort.InferenceSession(str(directory / self.FILES[2]), opts, providers=providers)

    def embed_users(self, rating_rows: np.ndarray) -> np.ndarray:
        """User embeddings from dense rating rows: (b, m) -> (b, d) float32."""
        return self.row.run(None, {"ratings": rating_rows.astype(np.float32)})[0]

    def embed_items(self, rating_cols: np.ndarray) -> np.ndarray:
        """Item embeddings from dense rating columns: (b, n) -> (b, d) float32."""
        return self.col.run(None, {"ratings": rating_cols.astype(np.float32)})[0]

    def probabilities(self, user_emb: np.ndarray, item_emb: np.ndarray) -> np.ndarray:
        """Label probabilities of paired embeddings: (K, d), (K, d) -> (K, p) float32."""
        feeds = {"user": user_emb.astype(np.float32), "item": item_emb.astype(np.float32)}
        return self.decoder.run(None, feeds)[0]
