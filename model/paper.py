"""The paper's test-time procedure: mean-field CRFs over random row x column blocks, averaged.

Rows and columns are split at random into subsets; in each block (row subset x column subset) that holds a
query, a CRF over the block's known entries and its queried entries runs the T mean-field layers; the
distributions from R random partitions are averaged ("Experiments" in the paper).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from model.config import Crf, MessageScaling, PaperSettings
from model.engine import Network, compatibility_matrix, mean_field
from model.exact.explain import NO_TERMS, CannotExplain, Explanation
from model.ratings import Ratings, ranges
from model.types import FloatArray, IntArray

BLOCK_BUDGET = 1 << 21
"""Padded similarity entries per batch of blocks: bounds the (B, W, W) temporaries."""


@dataclass(frozen=True)
class Partitions:
    """The R random row x column partitions of one setting, drawn once from its seed.

    The draws are those of `np.random.default_rng(seed)`: per repeat a permutation of the rows, then one of
    the columns; group g holds the permuted positions [g * subset, (g + 1) * subset). Everything that depends
    only on the model and the partitions (known entries sorted by block, scaled-cosine Gram matrices of every
    row and column group) is computed here once, so a request pays only for the blocks it touches.
    """

    subset_rows: int
    subset_cols: int
    n_col_groups: int
    row_group: IntArray  # (R, n) group of each row
    col_group: IntArray  # (R, m)
    row_local: IntArray  # (R, n) position of each row inside its group
    col_local: IntArray  # (R, m)
    known_order: IntArray  # (R, N) known entries sorted by block (stable: ties keep entry order)
    known_sorted: IntArray  # (R, N) their block ids
    row_gram: FloatArray  # (R, row groups * subset_rows^2) s_r within each row group, flattened
    col_gram: FloatArray  # (R, col groups * subset_cols^2) s_c within each column group, flattened

    @property
    def repeats(self) -> int:
        """Number R of partitions."""
        return len(self.row_group)


def _group_grams(unit: FloatArray, perm: IntArray, subset: int) -> FloatArray:
    """Scaled cosines (1 + cos) / 2 of the members of each group, flattened: (groups * subset^2,)."""
    groups = -(-len(perm) // subset)
    flat = np.zeros((groups * subset, unit.shape[1]))
    flat[: len(perm)] = unit[perm]
    members = flat.reshape(groups, subset, -1)  # (groups, subset, d)
    out: FloatArray = ((1.0 + members @ members.transpose(0, 2, 1)) / 2.0).ravel()
    return out


def draw_partitions(network: Network, known: Ratings, settings: PaperSettings) -> Partitions:
    """Draw the `settings.repeats` partitions of `settings.seed` and precompute their per-model tables."""
    n, m = network.n_users, network.n_items
    rng = np.random.default_rng(settings.seed)
    sr, sc = settings.subset_rows, settings.subset_cols
    n_col_groups = -(-m // sc)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("rg", "cg", "rl", "cl", "ko", "ks", "rgm", "cgm")}
    user_unit, item_unit = network.user_unit, network.item_unit  # made from the lifted rows, once
    for _ in range(settings.repeats):
        row_perm, col_perm = rng.permutation(n), rng.permutation(m)
        rank_r, rank_c = np.empty(n, dtype=np.int64), np.empty(m, dtype=np.int64)
        rank_r[row_perm], rank_c[col_perm] = np.arange(n), np.arange(m)
        row_group, col_group = rank_r // sr, rank_c // sc
        known_block = row_group[known.rows] * n_col_groups + col_group[known.cols]
        order = np.argsort(known_block, kind="stable")
        parts["rg"].append(row_group)
        parts["cg"].append(col_group)
        parts["rl"].append(rank_r % sr)
        parts["cl"].append(rank_c % sc)
        parts["ko"].append(order)
        parts["ks"].append(known_block[order])
        parts["rgm"].append(_group_grams(user_unit, row_perm, sr))
        parts["cgm"].append(_group_grams(item_unit, col_perm, sc))
    stack = {k: np.stack(v) for k, v in parts.items()}
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


class PaperScorer:
    """The `paper` mode over one network and its known ratings; partitions are drawn at construction."""

    def __init__(
        self,
        network: Network,
        known: Ratings,
        crf: Crf,
        settings: PaperSettings,
        message_scaling: MessageScaling = "sum",
    ) -> None:
        self.network, self.known, self.crf, self.settings = network, known, crf, settings
        self.message_scaling = message_scaling
        self.compat = compatibility_matrix(network.levels, crf.tau)
        self.known_probs = network.probabilities(known.rows, known.cols)  # (N, p)
        self.parts = draw_partitions(network, known, settings)

    blocking = True
    baseline_weight = 0.0

    def unmixed(
        self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None
    ) -> tuple[FloatArray, FloatArray | None]:
        """`predict`'s distributions; no baseline."""
        return self.predict(rows, cols, query_probs), None

    def row_parts(self, user: int, previous: object = None) -> None:
        """None: a query's answer depends on the others asked with it (their blocks), not on parts."""
        return None

    def from_parts(self, parts: object, cols: IntArray) -> tuple[FloatArray, FloatArray | None]:
        """Never called: `row_parts` gives none."""
        raise TypeError("the paper mode has no row parts")

    def answer(self, user: int, cols: IntArray) -> tuple[FloatArray, FloatArray | None] | None:
        """None: the paper mode's answers are its block CRFs (`unmixed`)."""
        return None

    def updated(
        self,
        network: Network,
        known: Ratings,
        users: IntArray,
        items: IntArray | None = None,
        tables: Mapping[str, np.ndarray] | None = None,
    ) -> PaperScorer:
        """The scorer once ratings arrived online: the partitions are drawn again over the grown matrix."""
        return PaperScorer(network, known.compact(), self.crf, self.settings, self.message_scaling)

    def online_tables(self) -> dict[str, np.ndarray]:
        """Nothing that the ratings do not give back: the partitions are drawn again."""
        return {}

    def prepare(self) -> None:
        """Nothing to prepare: each query's block CRFs are built for it."""

    def explain(self, user: int, items: IntArray, k: int) -> list[Explanation]:
        """The block CRFs' answers average random partitions: no term per known rating to take out."""
        raise CannotExplain(NO_TERMS.format(mode="paper"))

    def predict(self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None) -> FloatArray:
        """Final distributions of the queried entries (rows[k], cols[k]): (K, p), the average over the
        partitions of each query's block CRF; `query_probs`: the network's, computed here when not given."""
        if query_probs is None:
            query_probs = self.network.probabilities(rows, cols)
        parts = self.parts
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
        start = 0
        while start < len(order):
            stop = start + 1
            while stop < len(order) and (stop + 1 - start) * int(sizes[order[stop]]) ** 2 <= BLOCK_BUDGET:
                stop += 1
            chosen = order[start:stop]
            queries, final = self._run_blocks(
                rows,
                cols,
                query_probs,
                rep[chosen],
                block[chosen],
                lo[chosen],
                n_known[chosen],
                query_start[chosen],
                n_query[chosen],
                query_order,
            )
            np.add.at(total, queries, final)
            start = stop
        out: FloatArray = total / parts.repeats
        return out

    def _run_blocks(
        self,
        rows: IntArray,
        cols: IntArray,
        query_probs: FloatArray,
        rep: IntArray,
        block: IntArray,
        lo: IntArray,
        n_known: IntArray,
        query_start: IntArray,
        n_query: IntArray,
        query_order: IntArray,
    ) -> tuple[IntArray, FloatArray]:
        """Mean-field over a batch of blocks, padded to the largest: (queries, their final distributions)."""
        parts, known = self.parts, self.known
        n_blocks, p = len(rep), query_probs.shape[1]
        width = int((n_known + n_query).max())
        # Node slots: known entries first, then the block's queries, then padding.
        kb, kpos = ranges(lo, n_known)
        members = parts.known_order[rep[kb], kpos]
        kslot = kpos - lo[kb]
        qb, qpos = ranges(query_start, n_query)
        queries = query_order[qpos]
        qslot = n_known[qb] + qpos - query_start[qb]
        node_rows = np.zeros((n_blocks, width), dtype=np.int64)
        node_cols = np.zeros((n_blocks, width), dtype=np.int64)
        probs = np.full((n_blocks, width, p), 1.0 / p)
        mask = np.zeros((n_blocks, width))
        node_rows[kb, kslot], node_cols[kb, kslot] = known.rows[members], known.cols[members]
        node_rows[qb, qslot], node_cols[qb, qslot] = rows[queries], cols[queries]
        probs[kb, kslot], probs[qb, qslot] = self.known_probs[members], query_probs[queries]
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
        if self.message_scaling == "normalized":
            sim /= np.maximum(sim.sum(axis=2, keepdims=True), 1e-12)
        final = mean_field(probs, sim, self.compat, self.crf.gamma, self.crf.layers)
        return queries, final[qb, qslot]
