"""The DCMC network in torch: base prediction network plus unfolded mean-field layers.

This is the only module of `model/` that imports torch (training and ONNX export).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig

# torch's notes that CSR tensors are a beta feature and skip invariant checks (our CSR comes from scipy,
# sorted and in range): said once per process, to every user, about nothing they can act on.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
warnings.filterwarnings(
    "ignore", message="Sparse invariant checks are implicitly disabled", category=UserWarning
)


@dataclass(frozen=True)
class SparseRows:
    """A batch of rating rows (or columns) in compressed form, what a branch reads in training: row r's
    ratings are values[indptr[r]:indptr[r + 1]] at positions indices[...] of a line of `width`."""

    indptr: np.ndarray  # (b + 1,) int64
    indices: np.ndarray  # (nnz,) int64
    values: torch.Tensor  # (nnz,) float32
    width: int

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def dense(self) -> torch.Tensor:
        """The same rows as a dense (b, width) float32 tensor."""
        out = torch.zeros(len(self), self.width)
        owner = np.repeat(np.arange(len(self)), np.diff(self.indptr))
        out[torch.from_numpy(owner), torch.from_numpy(self.indices)] = self.values
        return out

    def dropout(self, p: float, rescale: bool = True) -> SparseRows:
        """Dropout on the ratings (a dense row's zeros stay zero either way); `rescale` False zeroes the
        dropped ratings without scaling the others by 1 / (1 - p), for a first layer that centres or
        normalises its input (a zero is then a missing rating: RatingInput)."""
        if rescale:
            return SparseRows(self.indptr, self.indices, F.dropout(self.values, p), self.width)
        keep = torch.rand(len(self.values)) >= p
        return SparseRows(self.indptr, self.indices, self.values * keep, self.width)


def _csr(m: sp.csr_matrix) -> torch.Tensor:
    """A scipy CSR matrix (sorted indices) as a torch sparse CSR tensor."""
    return torch.sparse_csr_tensor(
        torch.from_numpy(m.indptr.astype(np.int64)),
        torch.from_numpy(m.indices.astype(np.int64)),
        torch.from_numpy(m.data),
        size=m.shape,
    )


class _SparseProduct(torch.autograd.Function):
    """rows @ weight for compressed rows: only the weight's lines of the columns the batch rated are read,
    and the weight's gradient is a sparse (coalesced) tensor over those lines, so a step costs the batch's
    ratings, not its rows x the catalogue."""

    @staticmethod
    def forward(
        ctx: Any, weight: torch.Tensor, indptr: np.ndarray, indices: np.ndarray, values: torch.Tensor
    ) -> torch.Tensor:
        rows = sp.csr_matrix((values.detach().numpy(), indices, indptr), shape=(len(indptr) - 1, len(weight)))
        rows.sort_indices()
        ctx.rows, ctx.weight_shape = rows, weight.shape
        # The product reads the touched lines in place (gathering them first took twice as long).
        out: torch.Tensor = torch.sparse.mm(_csr(rows), weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # Built here: embedding without gradients never needs the transpose.
        transposed = ctx.rows.T.tocsr()  # (lines, batch)
        touched = np.flatnonzero(np.diff(transposed.indptr))
        lines = torch.sparse.mm(_csr(transposed[touched]), grad.contiguous())
        index = torch.from_numpy(touched.astype(np.int64))[None]
        out = torch.sparse_coo_tensor(index, lines, ctx.weight_shape, is_coalesced=True)
        return out, None, None, None


class RatingInput(nn.Module):
    """The first layer of a branch, x' W + b, with W stored input-major (in_dim, out_dim) so that a batch
    of compressed rating rows reads (and its gradient touches) only the lines of the columns it rated.
    A dense input (ONNX export, tests) is an ordinary matrix product, its zeros the missing ratings.
    Initialised as nn.Linear.

    x' is the line's known ratings minus `center`, divided by 1, sqrt(n) or n for a line of n ratings
    (`scaling` none, sqrt, mean; ModelConfig.input_center and input_scaling); the missing entries stay 0."""

    def __init__(self, in_dim: int, out_dim: int, center: float = 0.0, scaling: str = "none") -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_dim)
        self.weight = nn.Parameter(torch.empty(in_dim, out_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(out_dim).uniform_(-bound, bound))
        self.center = float(center)
        self.power = {"none": 0.0, "sqrt": 0.5, "mean": 1.0}[scaling]

    def forward(self, x: torch.Tensor | SparseRows) -> torch.Tensor:
        if isinstance(x, SparseRows):
            values = x.values
            if self.center or self.power:
                # As the dense path: a zero (an input dropout's) is a missing rating, neither centred nor
                # counted.
                known = (values != 0).to(values.dtype)
                values = values - self.center * known
                if self.power:
                    lengths = np.diff(x.indptr)
                    owner = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))
                    counts = torch.zeros(len(lengths)).index_add_(0, owner, known)
                    values = values * counts.clamp_min(1.0).pow(-self.power)[owner]
            out: torch.Tensor = _SparseProduct.apply(  # type: ignore[no-untyped-call]
                self.weight, x.indptr, x.indices, values
            )
            return out + self.bias
        if self.center or self.power:
            known = (x != 0).to(x.dtype)
            x = x - self.center * known
            if self.power:
                x = x * known.sum(dim=1, keepdim=True).clamp_min(1.0).pow(-self.power)
        return torch.addmm(self.bias, x, self.weight)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # Weights written before the input-major layout (nn.Linear's (out, in)) load transposed.
        w = state_dict.get(prefix + "weight")
        if w is not None and w.shape == self.weight.shape[::-1] and w.shape != self.weight.shape:
            state_dict[prefix + "weight"] = w.t().contiguous()
        super()._load_from_state_dict(state_dict, prefix, *args)


def _branch(
    in_dim: int, hidden: tuple[int, ...], dropout: float, center: float = 0.0, scaling: str = "none"
) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k, width in enumerate(hidden):
        first = RatingInput(in_dim, width, center, scaling) if k == 0 else nn.Linear(in_dim, width)
        layers += [first, nn.BatchNorm1d(width)]
        if k < len(hidden) - 1:  # ReLU + dropout on all but the last layer
            layers += [nn.ReLU(), nn.Dropout(dropout)]
        in_dim = width
    return nn.Sequential(*layers)


def compatibility_matrix(levels: torch.Tensor, tau: float) -> torch.Tensor:
    """C[u, v] = min((L_u - L_v)^2, tau): the truncated quadratic label compatibility."""
    diff = levels[:, None] - levels[None, :]
    return torch.clamp(diff * diff, max=tau)


def scaled_cosine(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(1 + cos(x_a, y_b)) / 2 for every pair of rows: a similarity in [0, 1]."""
    xn = F.normalize(x, dim=-1)
    yn = F.normalize(y, dim=-1)
    return (1.0 + xn @ yn.T) / 2.0


def _node_similarity(x: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """scaled_cosine(x, x)[nodes][:, nodes], from the smaller of the two products: all b x b pairs of the
    batch's lines then gathered (a dense block), or the K x K pairs of the nodes' lines directly (a sparse
    block, where the K nodes are far fewer than b^2)."""
    if len(x) <= len(nodes):
        return scaled_cosine(x, x)[nodes][:, nodes]
    picked = x[nodes]
    return scaled_cosine(picked, picked)


def mean_field(
    log_p: torch.Tensor,
    sim: torch.Tensor,
    compat: torch.Tensor,
    gamma: float,
    layers: int,
    normalized: bool = False,
) -> torch.Tensor:
    """Run `layers` unfolded mean-field iterations and return the final log-probabilities.

    log_p: (K, p) log label probabilities of the base network (unary = -log_p);
    sim: (K, K) entry similarities; compat: (p, p) label compatibilities. `normalized` divides each
    node's messages by sum_l s(k, l).
    """
    if normalized:
        sim = sim / sim.sum(dim=1, keepdim=True).clamp_min(1e-12)
    unary = -log_p  # (K, p)
    log_q = log_p
    for _ in range(layers):
        q_prime = log_q.exp() @ compat.T  # (K, p) compatibility transform
        messages = sim @ q_prime  # (K, p) message passing
        log_q = torch.log_softmax(-(unary + gamma * messages), dim=-1)
    return log_q


def lift(x: torch.Tensor) -> torch.Tensor:
    """a = [1, x / |x|] / sqrt(2), so that a . a' is the scaled cosine of x and x': (K, d) -> (K, d + 1)."""
    out: torch.Tensor = torch.cat([torch.ones_like(x[:, :1]), F.normalize(x, dim=-1)], dim=1) / 2.0**0.5
    return out


def factorized_messages(a: torch.Tensor, b: torch.Tensor, q_prime: torch.Tensor) -> torch.Tensor:
    """m_k = sum_l (a_k . a_l)(b_k . b_l) Q'_l without the K x K matrix: G_u = sum_l Q'_l[u] a_l b_l^T,
    m_k[u] = a_k^T G_u b_k. a, b: (K, D) lifted node embeddings; q_prime: (K, p) -> (K, p)."""
    g = torch.einsum("ki,ku,kj->uij", a, q_prime, b)  # (p, D, D)
    return torch.einsum("ki,uij,kj->ku", a, g, b)


class DCMC(nn.Module):
    """Deep CRF for matrix completion (Nguyen et al.).

    Base prediction network: a row branch maps a user's rating row M^r_i (length m, missing = 0) to an
    embedding U_i in R^d, and a column branch maps an item's column M^c_j (length n) to V_j. Each branch is
    FC+BatchNorm layers with ReLU and dropout on all but the last. A bilinear decoder scores each level,
    G_ij^u = U_i^T B^u V_j, and P(M_ij = L_u) = softmax_u(G_ij).

    Entry similarity: s(i1 j1, i2 j2) = s_r(i1, i2) s_c(j1, j2) with s_r, s_c the cosine similarities of
    the embeddings linearly scaled to [0, 1].

    CRF: unary Phi_k(u) = -ln P_k(u); pairwise Psi = gamma s(k, l) mu(u, v) with
    mu(u, v) = min((L_u - L_v)^2, tau). Each of the T mean-field layers computes
    Q' = Q C^T (compatibility transform), Q'' = S Q' (message passing) and
    Q = softmax(-(Phi + gamma Q'')). Training minimises the cross-entropy of the last layer plus
    beta times the MSE between S and exp(-(M_k - M_l)^2 / sigma^2) over pairs of observed entries.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.embedding_dim
        inputs = (config.input_center, config.input_scaling)
        self.row_branch = _branch(config.n_items, config.hidden, config.dropout, *inputs)
        self.col_branch = _branch(config.n_users, config.hidden, config.dropout, *inputs)
        self.bilinear = nn.Parameter(torch.randn(config.n_levels, d, d) / d)  # (p, d, d)
        levels = torch.tensor(config.levels, dtype=torch.float32)
        self.register_buffer("levels", levels, persistent=False)
        self.register_buffer("compat", compatibility_matrix(levels, config.tau), persistent=False)

    def embed_rows(self, rows: torch.Tensor | SparseRows) -> torch.Tensor:
        """User embeddings from rating rows (dense or compressed): (b, m) -> (b, d)."""
        out: torch.Tensor = self.row_branch(rows)
        return out

    def embed_cols(self, cols: torch.Tensor | SparseRows) -> torch.Tensor:
        """Item embeddings from rating columns (dense or compressed): (b, n) -> (b, d)."""
        out: torch.Tensor = self.col_branch(cols)
        return out

    def scores(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bilinear scores of paired embeddings: (K, d), (K, d) -> (K, p)."""
        return torch.einsum("kd,pde,ke->kp", u, self.bilinear, v)

    def block_scores(
        self, u: torch.Tensor, v: torch.Tensor, node_rows: torch.Tensor, node_cols: torch.Tensor
    ) -> torch.Tensor:
        """scores(u[node_rows], v[node_cols]) for a block's K entries: (br, d), (bc, d) -> (K, p).

        Paired, each entry costs p d^2 (its row's embedding through every B^u). Where the block has fewer
        lines on one side than entries, that side goes through the decoder once per line instead
        (B^u v_j for each column j, or U_i^T B^u for each row i: lines x p d^2) and each entry then
        costs one (p, d) x d product: on a dense block (ml-10m's hold 13,000 entries on 445 columns)
        the decoder's work drops by the ratio of entries to lines."""
        if min(len(u), len(v)) >= len(node_rows):
            return self.scores(u[node_rows], v[node_cols])
        if len(v) <= len(u):
            sides = torch.einsum("pde,be->bpd", self.bilinear, v)  # (bc, p, d): B^u v_j
            return torch.bmm(sides[node_cols], u[node_rows].unsqueeze(2)).squeeze(2)
        sides = torch.einsum("bd,pde->bpe", u, self.bilinear)  # (br, p, d): U_i^T B^u
        return torch.bmm(sides[node_rows], v[node_cols].unsqueeze(2)).squeeze(2)

    def forward(
        self,
        rows: torch.Tensor | SparseRows,
        cols: torch.Tensor | SparseRows,
        node_rows: torch.Tensor,
        node_cols: torch.Tensor,
        mf_layers: int | None = None,
        similarity: bool = True,
        sample: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Score the K entries (node_rows[k], node_cols[k]) of a batch.

        rows: (br, m) rating rows; cols: (bc, n) rating columns (dense or compressed); node_rows /
        node_cols: (K,) indices into the batch. Returns (base log-probabilities (K, p), final
        log-probabilities after the mean-field layers (K, p), entry similarities (K, K)).
        `similarity=False` with no mean-field layers skips the K x K similarities (None), which nothing
        then needs; `sample` (indices into the K entries) with no mean-field layers returns the
        similarities of those entries only (len(sample), len(sample)).
        """
        u = self.embed_rows(rows)  # (br, d)
        v = self.embed_cols(cols)  # (bc, d)
        log_p = torch.log_softmax(self.block_scores(u, v, node_rows, node_cols), dim=-1)  # (K, p)
        layers = self.config.mf_layers if mf_layers is None else mf_layers
        if not similarity and layers == 0:
            return log_p, log_p, None
        if sample is not None and layers == 0:
            node_rows, node_cols = node_rows[sample], node_cols[sample]
        sim = _node_similarity(u, node_rows) * _node_similarity(v, node_cols)  # (K, K)
        normalized = self.config.message_scaling == "normalized"
        compat: torch.Tensor = self.compat  # type: ignore[assignment]  # a registered buffer
        log_q = mean_field(log_p, sim, compat, self.config.gamma, layers, normalized)
        return log_p, log_q, sim


def _block_diagonal(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The matrices on the diagonal of one, zeros elsewhere."""
    out: torch.Tensor = torch.block_diag(*blocks)  # type: ignore[no-untyped-call]
    return out


@torch.no_grad()
def fuse(members: list[DCMC]) -> DCMC:
    """One network that serves N trained networks of one config side by side (eval mode): each branch's
    embedding is the members' embeddings concatenated (d -> N d) and the decoder averages their scores,
    G_ij^u = (1/N) sum_n U_{n,i}^T B_n^u V_{n,j}, so its softmax is the members' geometric mean
    distribution, renormalised. An ordinary DCMC (config `hidden` N times as wide; the first layers read
    the same input, the later ones are block diagonal), so the exporter, the ONNX graphs, the artifact
    and the service need nothing else; the scaled cosine of the concatenated embeddings weighs each
    member's cosine by its share of the norms. Not trainable as an ensemble (BatchNorm in training mode
    would mix the members' batches); train the members, then fuse."""
    if not members:
        raise ValueError("fuse needs at least one network")
    cfg = members[0].config
    if any(m.config != cfg for m in members[1:]):
        raise ValueError("the networks of an ensemble share one ModelConfig")
    if len(members) == 1:
        return members[0]
    n = len(members)
    wide = DCMC(replace(cfg, hidden=tuple(n * h for h in cfg.hidden)))
    for branch in ("row_branch", "col_branch"):
        layers = zip(getattr(wide, branch), *(getattr(m, branch) for m in members), strict=True)
        for target, *parts in layers:
            if isinstance(target, RatingInput):  # one input, the members' units side by side
                target.weight.copy_(torch.cat([p.weight for p in parts], dim=1))
                target.bias.copy_(torch.cat([p.bias for p in parts]))
            elif isinstance(target, nn.Linear):  # each member's units read its own
                target.weight.copy_(_block_diagonal([p.weight for p in parts]))
                target.bias.copy_(torch.cat([p.bias for p in parts]))
            elif isinstance(target, nn.BatchNorm1d):
                for name in ("weight", "bias", "running_mean", "running_var"):
                    getattr(target, name).copy_(torch.cat([getattr(p, name) for p in parts]))
                if len({p.eps for p in parts} | {target.eps}) != 1:
                    raise ValueError("the members' BatchNorm layers differ")
    levels = range(cfg.n_levels)
    wide.bilinear.copy_(torch.stack([_block_diagonal([m.bilinear[u] for m in members]) for u in levels]) / n)
    return wide.eval()
