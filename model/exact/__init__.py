"""Exact mean-field messages over every known entry in linear time (numpy): the `exact` inference mode.

One concept per module: `affinity` (co-rating tables), `messages` (the kernel's messages over the known
entries), `lines` (line and co-rating terms), `field` (the known field), `posterior` (a query's final
distribution), `baseline` (the bias baseline), `scorer` (`ExactScorer`). The maths, once:

With unit embeddings, the scaled cosine is an inner product of lifted vectors:
(1 + u_i . u_i') / 2 = a_i . a_i' with a_i = [1, u_i] / sqrt(2) (D = d + 1 numbers), and likewise
s_c(j, j') = b_j . b_j'. So for nodes k = (i, j) and l = (i', j'),

    s(k, l) = (a_i . a_i') (b_j . b_j')   and   m_k[u] = sum_l s(k, l) Q'_l[u] = a_i^T G_u b_j,

with G_u = sum_l Q'_l[u] a_{i_l} b_{j_l}^T, a D x D matrix per level. Building every G_u costs
O(K D p + n D^2 p) and reading one message O(D^2 p) per distinct user plus O(D p) per entry, instead of the
O(K^2 p) of the dense similarity matrix. Nothing is approximated: the sums run over every node. (One
user's whole catalogue reads the item side in float32, `engine.catalogue_products`: to about 1e-6.)

A sharper kernel keeps both properties. The scaled cosine never drops far below 1/4, so the product kernel
weighs every known entry almost alike. Two optional terms concentrate the weight on the entries that share
the query's user or item:

    s'(k, l) = s_r(i, i') s_c(j, j') + lambda_u [i = i'] s_c(j, j') + lambda_i [j = j'] s_r(i, i').

Both are sums over one user's row or one item's column (`LineIndex`), so a message still costs
O(|entries on the touched rows and columns| D p), and nothing is approximated.

The product of scaled cosines stays a similarity of embeddings the decoder already reads. A third term
brings in what it does not use, the co-rating of items (item-based kNN inside the CRF):

    + lambda_r [i = i'] w(j, j'),   w(j, j') = max(0, rho(j, j'))^q,

rho the adjusted cosine of the two items' training rating columns (each user's mean removed), shrunk by
n_jj' / (n_jj' + s) with n_jj' the users who rated both (`co_rating_affinity`; s = 10 by default). It
is again a sum over the query's row, with the m x m table of w computed once per model. Its mirror, user-based
kNN on the query's column,

    + lambda_c [j = j'] w_u(i, i'),   w_u(i, i') = max(0, rho_u(i, i'))^q,

weighs the other users' ratings of the query's item by the adjusted cosine of the users' rating rows
(each item's mean removed, the same shrinkage), from an n x n table.

With normalized messages a pseudo-count c adds (lambda_r + lambda_c) c to the normaliser alone (an absent
neighbour that sends nothing): a query whose co-rated neighbours weigh W in all keeps about W / (W + c) of
their pull, so a user with few or weakly similar rated items stays closer to the base network.

A bias baseline can join the CRF's output (`baseline_mixture`): the final distribution of a query is
(1 - w) Q + w B, with B the two-level distribution whose expectation is the prediction mu + b_i + c_j of
ridge-regularised user and item biases fitted to the known ratings (`bias_baseline`). It is not a kernel
term: the known field does not depend on it. On the two sparsest matrices (Flixster, YahooMusic) such a
baseline predicts about as well as the network alone or better, and the mixture beats both (see
benchmarks/results/validation.md).

Many levels (YahooMusic has 69) make reading the p matrices G_u the main cost of a request. When the
compatibility is not truncated, C[u, v] = (L_u - L_v)^2 = L_u^2 - 2 L_u L_v + L_v^2, so every
G_u = sum_l (sum_v Q_l[v] C[u, v]) a b^T is a quadratic polynomial in L_u: three levels determine all p
(`LevelInterpolation`), and a query reads 3 matrices instead of p, still exactly.
"""

from __future__ import annotations

from model.exact.affinity import (
    CO_RATING_NEIGHBOURS,
    DENSE_TABLE_MAX,
    FRESH_CHUNK_CELLS,
    Affinity,
    DenseAffinity,
    FreshLines,
    SparseAffinity,
)
from model.exact.baseline import BIAS_SWEEPS, BiasModel, baseline_mixture, bias_baseline, level_distribution
from model.exact.field import KnownField, LevelInterpolation, known_field, scaled_messages
from model.exact.gram import (
    GRAM_BLAS_LINES,
    GRAM_CHUNK_PAIRS,
    GRAM_PAIR_BUDGET,
    PRODUCT_CHUNK_CELLS,
    PRODUCT_UNITS_PER_PAIR,
    CoRatingGram,
    co_rating_affinity,
    co_rating_affordable,
    co_rating_rows,
    gram_cost,
)
from model.exact.lines import Lines
from model.exact.messages import (
    CLAMPED_CHUNK_ROWS,
    FEW_USERS,
    LINE_BLAS_SPEEDUP,
    LINE_LOOP_COST,
    MEMBER_CHUNK,
    NODE_CHUNK,
    PAIR_CHUNK,
    QUERY_CHUNK,
    ClampedRows,
    ColumnMajor,
    Distributions,
    FactorizedGraph,
    Products,
    affinity_messages,
    clamped_sums,
    column_pass,
    dense_similarity,
    line_messages,
    member_weights,
    read_messages,
)
from model.exact.posterior import (
    LOG_FLOOR,
    catalogue_posterior,
    posterior,
    query_distributions,
    user_distributions,
)
from model.exact.scorer import ExactParts, ExactScorer, FieldKey, RowParts

__all__ = [
    "BIAS_SWEEPS",
    "CLAMPED_CHUNK_ROWS",
    "CO_RATING_NEIGHBOURS",
    "DENSE_TABLE_MAX",
    "FEW_USERS",
    "FRESH_CHUNK_CELLS",
    "GRAM_BLAS_LINES",
    "GRAM_CHUNK_PAIRS",
    "GRAM_PAIR_BUDGET",
    "LINE_BLAS_SPEEDUP",
    "LINE_LOOP_COST",
    "LOG_FLOOR",
    "MEMBER_CHUNK",
    "NODE_CHUNK",
    "PAIR_CHUNK",
    "PRODUCT_CHUNK_CELLS",
    "PRODUCT_UNITS_PER_PAIR",
    "QUERY_CHUNK",
    "Affinity",
    "BiasModel",
    "ClampedRows",
    "CoRatingGram",
    "ColumnMajor",
    "DenseAffinity",
    "Distributions",
    "ExactParts",
    "ExactScorer",
    "FactorizedGraph",
    "FieldKey",
    "FreshLines",
    "KnownField",
    "LevelInterpolation",
    "Lines",
    "Products",
    "RowParts",
    "SparseAffinity",
    "affinity_messages",
    "baseline_mixture",
    "bias_baseline",
    "catalogue_posterior",
    "clamped_sums",
    "co_rating_affinity",
    "co_rating_affordable",
    "co_rating_rows",
    "column_pass",
    "dense_similarity",
    "gram_cost",
    "known_field",
    "level_distribution",
    "line_messages",
    "member_weights",
    "posterior",
    "query_distributions",
    "read_messages",
    "scaled_messages",
    "user_distributions",
]
