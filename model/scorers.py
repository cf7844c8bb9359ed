"""One scorer per inference mode, built once from the network and the known ratings; a thin dispatch.

    network  the base network alone (`none`, or T = 0)
    paper    model/paper.py: CRFs over random blocks, averaged over partitions
    exact    model/exact/: the CRF over every known entry with exact messages

Each scorer precomputes what it needs at construction and then answers `predict(rows, cols, probs)`.
`MeanScorer` averages the final distributions of several settings of one network (an artifact whose
training averaged several searches: `TrainConfig.searches`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from model.artifact import Artifact, StoredField
from model.config import ConfigError, InferenceConfig, ModelConfig, resolve_crf
from model.engine import Network, log_softmax
from model.exact import ExactParts, ExactScorer, RowParts, direct
from model.exact.baseline import baseline_mixture
from model.exact.explain import NO_TERMS, CannotExplain, Explanation, explain_mean
from model.exact.posterior import LOG_FLOOR
from model.exact.scorer import query_vectors
from model.paper import PaperScorer
from model.ratings import Ratings
from model.types import FloatArray, IntArray


class Scorer(Protocol):
    """Final label distributions of queried entries. Every mode's scorer answers the same calls, so a
    caller never needs its concrete type (the way one recommender interface serves every backend)."""

    blocking: bool
    """Whether a query costs tens of milliseconds of numpy (`paper`'s block CRFs): a server runs it off
    its event loop."""

    @property
    def baseline_weight(self) -> float:
        """Weight w of the bias baseline mixed into `predict`'s distributions (0: none)."""
        ...

    def predict(self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None) -> FloatArray:
        """(K, p) distributions of the entries (rows[k], cols[k]); `query_probs`: the base network's
        distributions of them, computed here when not given."""
        ...

    def unmixed(
        self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None
    ) -> tuple[FloatArray, FloatArray | None]:
        """What `predict` mixes: the CRF's distributions and the bias baseline's ratings (K,), None without
        one; `predict` = (1 - w) dist + w level_distribution(baseline) (`baseline_weight` w)."""
        ...

    def row_parts(self, user: int, previous: RowParts | None = None) -> RowParts | None:
        """The part of the user's answers that other users' ratings leave as it is, to answer from with
        `from_parts` in later states; None where the mode has no such part. `previous`: the user's parts of
        an earlier state with the same items, which the mode may update rather than compute anew."""
        ...

    def from_parts(self, parts: RowParts, cols: IntArray) -> tuple[FloatArray, FloatArray | None]:
        """`unmixed` of (parts.user, cols[k]) from `row_parts` (only called with parts this mode made)."""
        ...

    def answer(self, user: int, cols: IntArray) -> tuple[FloatArray, FloatArray | None] | None:
        """`unmixed` of one user's queries (user, cols[k]) by the mode's fused path (`exact` with clamped
        known entries: model/exact/direct.py), the same numbers to rounding; None where it has none."""
        ...

    def updated(
        self,
        network: Network,
        known: Ratings,
        users: IntArray,
        items: IntArray | None = None,
        tables: Mapping[str, np.ndarray] | None = None,
    ) -> Scorer:
        """The scorer once ratings arrived online (`users`: those whose row or embedding changed; `items`:
        those whose embedding changed; `tables`: `online_tables()` of the scorer that took them, given
        back by a restored snapshot)."""
        ...

    def online_tables(self) -> dict[str, np.ndarray]:
        """What `updated` built that the ratings do not give back, for a snapshot (plain arrays)."""
        ...

    def prepare(self) -> None:
        """Compute what answering will read for every user, before the scorer answers (a served state, at
        fold-in time); a scorer answers the same without it."""
        ...

    def explain(self, user: int, items: IntArray, k: int) -> list[Explanation]:
        """Which `k` known ratings moved each prediction (user, items[q]) most, by how much; CannotExplain
        where the mode's answers are not a sum of one term per known rating."""
        ...


class NetworkScorer:
    """The base network alone: the query's own probabilities."""

    blocking = False
    baseline_weight = 0.0

    def __init__(self, network: Network) -> None:
        self.network = network

    def predict(self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None) -> FloatArray:
        """The base network's distributions, unchanged."""
        return self.network.probabilities(rows, cols) if query_probs is None else query_probs

    def unmixed(
        self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None
    ) -> tuple[FloatArray, FloatArray | None]:
        """The network's distributions; no baseline."""
        return self.predict(rows, cols, query_probs), None

    def row_parts(self, user: int, previous: RowParts | None = None) -> RowParts | None:
        """None: the network's answers need no parts."""
        return None

    def from_parts(self, parts: RowParts, cols: IntArray) -> tuple[FloatArray, FloatArray | None]:
        """Never called: `row_parts` gives none."""
        raise TypeError("the network alone has no row parts")

    def answer(self, user: int, cols: IntArray) -> tuple[FloatArray, FloatArray | None] | None:
        """None: `unmixed` is the network's one product already."""
        return None

    def updated(
        self,
        network: Network,
        known: Ratings,
        users: IntArray,
        items: IntArray | None = None,
        tables: Mapping[str, np.ndarray] | None = None,
    ) -> NetworkScorer:
        """The new network (its embeddings are the online ones)."""
        return NetworkScorer(network)

    def online_tables(self) -> dict[str, np.ndarray]:
        """Nothing built online."""
        return {}

    def prepare(self) -> None:
        """Nothing to prepare: a query reads the network alone."""

    def explain(self, user: int, items: IntArray, k: int) -> list[Explanation]:
        """The network alone reads no known rating."""
        raise CannotExplain(NO_TERMS.format(mode="none"))


@dataclass(frozen=True)
class MeanParts(RowParts):
    """A `MeanScorer`'s row parts: each member's, in order (the inherited fields are the first's)."""

    members: tuple[RowParts, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.members)


class MeanScorer:
    """The mean of the final distributions of several scorers of one network and one set of known ratings
    (the settings of several searches: `TrainConfig.searches`). Each member mixes its own bias baseline
    in, so the mean is returned mixed (`baseline_weight` 0). Its expected rating is the members' mean, so
    a known rating's effect on it is the mean of its effects on the members: explanations stay exact."""

    baseline_weight = 0.0

    def __init__(self, members: Sequence[Scorer], levels: FloatArray) -> None:
        if len(members) < 2:
            raise ValueError(f"a mean of scorers needs at least two, got {len(members)}")
        self.members = tuple(members)
        self.levels = levels
        self.blocking = any(m.blocking for m in self.members)
        self.users: FloatArray | None = None
        """`prepare`'s table of every user's query vectors over the members (`query_vectors`), or None."""

    def _fused(self) -> list[ExactScorer] | None:
        """The members, when each has a fused path (`exact` with clamped known entries)."""
        exact = [m for m in self.members if isinstance(m, ExactScorer) and m.kernel.known == "clamped"]
        return exact if len(exact) == len(self.members) else None

    def prepare(self) -> None:
        """Every user's query vectors of every member in one table (`query_vectors`), when they fit."""
        exact = self._fused()
        self.users = None if exact is None else query_vectors(exact)

    def predict(self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None) -> FloatArray:
        """The members' final distributions, averaged (a new array: a member may hand back `query_probs`)."""
        out = np.array(self.members[0].predict(rows, cols, query_probs), dtype=np.float64)
        for member in self.members[1:]:
            out += member.predict(rows, cols, query_probs)
        out /= len(self.members)
        return out

    def unmixed(
        self, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None
    ) -> tuple[FloatArray, FloatArray | None]:
        """`predict`'s mean, each member's baseline already mixed in: no baseline left."""
        return self.predict(rows, cols, query_probs), None

    def row_parts(self, user: int, previous: RowParts | None = None) -> MeanParts | None:
        """Each member's parts (updated from `previous`'s where given); None when a member has none."""
        before = previous.members if isinstance(previous, MeanParts) else (None,) * len(self.members)
        parts = [m.row_parts(user, p) for m, p in zip(self.members, before, strict=True)]
        if any(p is None for p in parts):
            return None
        first = parts[0]
        assert first is not None
        return MeanParts(user, first.scores, first.own, members=tuple(p for p in parts if p is not None))

    def from_parts(self, parts: RowParts, cols: IntArray) -> tuple[FloatArray, FloatArray | None]:
        """`unmixed` from each member's parts: the mean of the members' mixed distributions."""
        assert isinstance(parts, MeanParts)
        answers = [m.from_parts(own, cols) for m, own in zip(self.members, parts.members, strict=True)]
        return self._mean(answers), None

    def _mean(self, answers: Sequence[tuple[FloatArray, FloatArray | None]]) -> FloatArray:
        """The mean of the members' (distributions, baseline) answers, each mixed with its baseline."""
        out: FloatArray | None = None
        for member, (dist, baseline) in zip(self.members, answers, strict=True):
            if baseline is not None:
                dist = baseline_mixture(dist, baseline, self.levels, member.baseline_weight)
            out = dist if out is None else out + dist
        assert out is not None
        out /= len(self.members)
        return out

    def answer(self, user: int, cols: IntArray) -> tuple[FloatArray, FloatArray | None] | None:
        """`unmixed` by each member's fused path: every member's item products and the decoder's scores
        in one matrix product (the members share the network), then each member's loop; None when a
        member has no fused path."""
        exact = self._fused()
        if exact is None:
            return None
        cols = np.asarray(cols, dtype=np.int64)
        first = exact[0]
        if self.users is not None and user < len(self.users):
            # The user's vectors as `prepare` read them; only a same-user term is added per query.
            vectors, at = [], 0
            for m in exact:
                rows = m.field_rows
                vectors.append(m.vectors(user, self.users[user, at : at + rows].copy()))
                at += rows
            read = first.read(cols, np.vstack([*vectors, self.users[user, at:]]))
        else:
            vectors = [m.vectors(user) for m in exact]
            read = first.read(cols, np.vstack([*vectors, first.probe(user)]))
        scores = read[:, -len(first.compat) :] * first.network.item_norms[cols][:, None]
        # Wide queries (a row over the catalogue) share the scores' floored log-softmax.
        wide = direct.WIDE * len(cols) >= first.network.n_items
        log_scores = np.maximum(log_softmax(scores), LOG_FLOOR) if wide else None
        answers = []
        at = 0
        for member, vec in zip(exact, vectors, strict=True):
            answered = member.answer(user, cols, read[:, at : at + len(vec)], scores, log_scores)
            at += len(vec)
            assert answered is not None  # clamped known entries
            answers.append(answered)
        return self._mean(answers), None

    def updated(
        self,
        network: Network,
        known: Ratings,
        users: IntArray,
        items: IntArray | None = None,
        tables: Mapping[str, np.ndarray] | None = None,
    ) -> MeanScorer:
        """Each member updated (`tables`: each member's under its prefix `m<k>.`)."""
        tables = tables or {}
        members = [
            m.updated(network, known, users, items, _member_tables(tables, k))
            for k, m in enumerate(self.members)
        ]
        return MeanScorer(members, self.levels)

    def online_tables(self) -> dict[str, np.ndarray]:
        """Each member's, its names prefixed `m<k>.`."""
        return {
            f"m{k}.{name}": a for k, m in enumerate(self.members) for name, a in m.online_tables().items()
        }

    def explain(self, user: int, items: IntArray, k: int) -> list[Explanation]:
        """The known ratings of largest mean effect over the members (all `exact` with clamped known
        entries, or CannotExplain)."""
        exact = [m for m in self.members if isinstance(m, ExactScorer)]
        if len(exact) < len(self.members):
            raise CannotExplain(NO_TERMS.format(mode="a mean with another mode"))
        return explain_mean(exact, user, items, k)


def _member_tables(tables: Mapping[str, np.ndarray], k: int) -> dict[str, np.ndarray] | None:
    prefix = f"m{k}."
    mine = {name.removeprefix(prefix): a for name, a in tables.items() if name.startswith(prefix)}
    return mine or None


def build_scorer(
    network: Network,
    known: Ratings,
    inference: InferenceConfig,
    stored: StoredField | None = None,
    parts: ExactParts | None = None,
) -> PaperScorer | ExactScorer | NetworkScorer:
    """The scorer of `inference.mode` with everything it precomputes; `stored`: the artifact's known
    field, used by `exact` when it was computed for the same settings; `parts`: what `exact` scorers of
    this network and these known ratings share (a search over the settings)."""
    crf = resolve_crf(network.config, inference.crf)
    if inference.mode == "none" or crf.layers == 0:
        return NetworkScorer(network)
    if inference.mode == "paper":
        return PaperScorer(network, known, crf, inference.paper, network.config.message_scaling)
    p = inference.paper
    scale = p.subset_rows * p.subset_cols / (network.n_users * network.n_items)
    return ExactScorer(network, known, crf, inference.kernel, inference.output, scale, stored, parts)


def check_inference(inference: InferenceConfig, model: ModelConfig) -> None:
    """Refuse (ConfigError), before any array is loaded, a setting the model cannot run."""
    if inference.mode not in ("exact", "paper", "none"):
        raise ConfigError(f"unknown inference mode {inference.mode!r}")


def load_network(artifact: Artifact, config: ModelConfig | None = None) -> Network:
    """The artifact's base network in float64 (`config` may replace its model config)."""
    return Network(
        config or artifact.config, artifact.user_embeddings, artifact.item_embeddings, artifact.bilinear
    )


def artifact_scorer(
    artifact: Artifact,
    inference: InferenceConfig | Sequence[InferenceConfig] | None = None,
    include_held_out: bool = True,
) -> tuple[Network, Scorer]:
    """The network and the scorer of an artifact under `inference` (default: its own settings,
    `Artifact.settings()`); several settings make a `MeanScorer`. `include_held_out=False` leaves the
    held-out validation ratings out of the known ratings (to score those very ratings), and the stored
    field, computed with them, too."""
    network = load_network(artifact)
    known = artifact.known(include_held_out)
    stored = artifact.stored_field(include_held_out)
    if inference is None:
        inference = artifact.settings()
    settings = [inference] if isinstance(inference, InferenceConfig) else list(inference)
    members = [build_scorer(network, known, s, stored) for s in settings]
    if len(members) == 1:
        return network, members[0]
    return network, MeanScorer(members, network.levels)


def predict_distributions(
    network: Network, scorer: Scorer, rows: IntArray, cols: IntArray, query_probs: FloatArray | None = None
) -> FloatArray:
    """Final distributions of (rows[k], cols[k]): (K, p); `query_probs` defaults to the network's."""
    if query_probs is None:
        query_probs = network.probabilities(rows, cols)
    if len(rows) == 0:
        return query_probs
    return scorer.predict(rows, cols, query_probs)
