"""Ratings that arrive after training, folded into the model without retraining.

The artifact is the state up to training; every rating since (from any writer, in one global order) is
applied on top of it by `FoldIn.apply`:

- the rating joins the known ratings; a re-rating of the same (user, item) replaces the earlier one,
  the artifact's included;
- the user's embedding is recomputed by the row branch (the exported ONNX graph) from the updated rating
  row, i.e. the network's input: the user's training ratings with the online ones added or replacing
  them. The row branch embeds any rating row, so a user id the artifact never saw gets the next index and
  an embedding from its first rating on. That embedding is then refined by the decoder's likelihood of
  the user's known ratings (model/refine.py): the row branch maps rows it was not trained on less well
  than those it was, and the refinement, which keeps it as a prior, recovers most of the difference
  (benchmarks/results/online.md);
- an item id the artifact never saw becomes a new item. The column branch embeds it from its ratings by
  users the model was trained on (the branch's input is a column over those users) as soon as it has one;
  until then it is not part of the CRF, and its predictions come from the bias baseline (`baseline`,
  `embedded`). The artifact's items keep their embeddings;
- the inference mode's scorer takes the change (`updated`): the exact CRF's known field by the changed
  rows' and columns' terms alone (model/exact/), the paper's partitions drawn again.

Catalogue changes (PUT and PATCH /items/{id}) arrive in the same stream and fold in with the ratings:
each changed item's record as it now is (`OnlineState.records`, over the artifact's catalogue), so a
snapshot covers them as it covers the ratings. They change no prediction.

Each state is a new immutable `OnlineState`, published by one assignment: a reader takes `fold.state`
once and sees one consistent model.
"""

from __future__ import annotations

import io
import json
import threading
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat

import numpy as np

from model.artifact import Artifact
from model.catalogue import ItemChange, ItemRecord
from model.config import InferenceConfig
from model.engine import Network, nearest_level
from model.exact import BiasModel, ExactScorer
from model.ratings import Ratings
from model.refine import refine_embedding, stacked_decoder
from model.scorers import Scorer, artifact_scorer
from model.stream import FORGET
from model.types import Array, IntArray

Embed = Callable[[Array], Array]
"""A branch of the network: dense rating rows (b, m) -> user embeddings (b, d), or dense rating columns
(b, n) -> item embeddings (b, d), float32 (the artifact's n x m matrix)."""

USER_SHRINK, ITEM_SHRINK = 2.0, 5.0
"""Ridge penalties of the bias baseline that predicts a new item until it has an embedding."""

SNAPSHOT_FORMAT = 3
"""The layout of `FoldIn.snapshot`'s payload; a snapshot of another layout is refused (1: before
catalogue changes)."""


class SnapshotError(ValueError):
    """A snapshot that does not fit this fold-in (another layout, another artifact, inconsistent arrays)."""


@dataclass(frozen=True)
class OnlineState:
    """The model with every online rating applied so far."""

    network: Network
    known: Ratings
    scorer: Scorer
    applied: int
    """How many online ratings this state includes."""
    embedded: np.ndarray
    """(items,) bool: which items have an embedding (every item of the artifact; a new one once the column
    branch could embed it); the others are predicted by `baseline`."""
    biases: BiasModel
    """The bias baseline that predicts items without an embedding."""
    online: Mapping[int, Mapping[int, float]] = field(default_factory=dict)
    """user -> item -> the user's latest online rating of it, for the ratings this state includes (every
    item and user index in it exists in this state)."""
    changed: Mapping[int, int] = field(default_factory=dict)
    """user -> `applied` of the state in which the user's known ratings or embedding last changed (users
    no online rating changed are absent: still the artifact's)."""
    items_changed: int = 0
    """`applied` of the state in which an item was last added or embedded (0: the artifact's items)."""
    forgotten: frozenset[int] = frozenset()
    """Users forgotten (DELETE /users/{id}): every rating of theirs taken back, and unknown to queries."""
    published: float = field(default_factory=time.monotonic)
    """When this state was made (time.monotonic): it holds every rating applied before then."""
    records: Mapping[str, ItemRecord] = field(default_factory=dict)
    """item id -> its catalogue record as online changes left it, for every item changed online (the
    others: the artifact's catalogue)."""
    record_versions: Mapping[str, int] = field(default_factory=dict)
    """item id -> `records_applied` of the state in which its record last changed."""
    records_applied: int = 0
    """How many online catalogue changes this state includes."""
    dismissed: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """external user id -> the external ids of the items they dismissed (`dismiss` events) since they
    were last forgotten: kept out of their lists."""
    dismissals_applied: int = 0
    """How many dismissals and forgets of users with dismissals this state includes."""

    @property
    def writes(self) -> int:
        """Online ratings, catalogue changes and dismissals this state includes (what a snapshot counts)."""
        return self.applied + self.records_applied + self.dismissals_applied

    def user_version(self, user: int) -> tuple[int, int]:
        """What the user's own part of its answers depends on (`ExactScorer.row_parts`): equal in two
        states when neither the user's ratings and embedding nor the items changed between them."""
        return self.changed.get(user, 0), self.items_changed

    def baseline(self, user: int, items: IntArray) -> np.ndarray:
        """The bias baseline's ratings mu + b_user + c_j: (K,)."""
        return self.biases.predict(user, items)


def _dismissed(state: OnlineState, dismissals: Sequence[tuple[str, str]]) -> OnlineState:
    """`state` with the (user, item) dismissals and (user, FORGET) forgets applied, in order (a forget of
    a user without dismissals changes nothing)."""
    dismissed = dict(state.dismissed)
    count = state.dismissals_applied
    for user, item in dismissals:
        if item == FORGET:
            if dismissed.pop(user, None) is not None:
                count += 1
        elif item not in dismissed.get(user, frozenset()):
            dismissed[user] = dismissed.get(user, frozenset()) | {item}
            count += 1
    if count == state.dismissals_applied:
        return state
    return replace(state, dismissed=dismissed, dismissals_applied=count, published=time.monotonic())


@dataclass
class _Checkpoint:
    """What a batch may change in a `FoldIn` before it publishes its state, to roll back to."""

    n_users: int
    n_items: int
    online: dict[int, dict[int, float]]
    new_items: dict[int, dict[int, float]]
    forgotten: set[int]
    taken_back: set[int]
    embedded: np.ndarray
    bias: BiasModel
    kept: list[np.ndarray]
    """Positions of the artifact's ratings the batch re-rated or took back (`_keep` was True there)."""


class FoldIn:
    """An artifact's model that takes ratings online (see the module docstring)."""

    def __init__(
        self,
        artifact: Artifact,
        inference: InferenceConfig | Sequence[InferenceConfig],
        embed_rows: Embed,
        embed_cols: Embed,
        refine_trained: bool = True,
    ) -> None:
        self.artifact = artifact
        self.refine_trained = refine_trained
        """Whether users the network was trained on are refined too (else: the others only)."""
        train = artifact.train
        self._trained = train.by_row.counts(np.arange(train.n_users)) > 0
        """(artifact users,) bool: which users the network was trained on, those with training ratings. A
        user of the artifact's vocabulary without any (only held-out ratings, or none) is embedded from a
        row the network never trained on, like a new user, and is always refined."""
        self._embed_rows, self._embed_cols = embed_rows, embed_cols
        network, scorer = artifact_scorer(artifact, inference)
        self._base = artifact.known()
        self._keep = np.ones(len(self._base), dtype=bool)  # artifact ratings not re-rated online
        self._users = list(artifact.users.ids)
        self._user_index = {user: i for i, user in enumerate(self._users)}
        self._items = list(artifact.items.ids)
        self._item_index = {item: j for j, item in enumerate(self._items)}
        self._online: dict[int, dict[int, float]] = {}  # user -> item -> latest online rating
        # Users forgotten before the artifact was trained (`dcmc train --online-ratings` records them):
        # their ratings are gone from it, and so they stay unknown, whatever the stream holds after.
        online = (artifact.meta.get("dataset") or {}).get("online_ratings") or {}
        listed = online.get("forgotten_users", [])
        recorded = [str(u) for u in listed] if isinstance(listed, list) else []  # a count before 0.2
        self._forgotten: set[int] = {self._user_index[u] for u in recorded if u in self._user_index}
        self._taken_back: set[int] = set()  # users an artifact rating of whom was taken back
        self._new_items: dict[int, dict[int, float]] = {}  # new item -> user -> rating
        self._embedded = np.ones(len(self._items), dtype=bool)  # new items: once the column branch can
        base = self._base
        output = (inference if isinstance(inference, InferenceConfig) else inference[0]).output
        stored = artifact.baseline
        if (
            isinstance(scorer, ExactScorer)
            and scorer.biases is not None
            and scorer.known is base
            and (output.baseline_user_shrink, output.baseline_item_shrink) == (USER_SHRINK, ITEM_SHRINK)
        ):
            # The scorer's own baseline is this fit (the same ratings and penalties): held once.
            self._bias: BiasModel = scorer.biases
        elif stored is not None and (stored.user_shrink, stored.item_shrink) == (USER_SHRINK, ITEM_SHRINK):
            # Fitted at export (`training.export.write_baseline`): refitting it here took 37 of a worker's
            # 40 s start-up on the synthetic ml-10m matrix (8 M ratings).
            users, items = np.asarray(stored.users, np.float64), np.asarray(stored.items, np.float64)
            self._bias = BiasModel(stored.mu, users, items, USER_SHRINK, ITEM_SHRINK)
        else:
            self._bias = BiasModel.fit(
                base.rows, base.cols, base.values, base.n_users, base.n_items, USER_SHRINK, ITEM_SHRINK
            )
        self._lock = threading.Lock()
        self._stacked = stacked_decoder(network.bilinear)  # the decoder never changes online: stacked once
        scorer.prepare()  # what answers read for every user, before the state is served
        self.state = OnlineState(
            network,
            self._base,
            scorer,
            0,
            self._embedded.copy(),
            self._bias,
            forgotten=frozenset(self._forgotten),
        )

    @property
    def n_users(self) -> int:
        """Users known so far: the artifact's, then the new ones in order of their first rating."""
        return len(self._users)

    @property
    def new_users(self) -> int:
        """Users the artifact did not have that ratings introduced (being folded in included)."""
        return len(self._users) - self.artifact.config.n_users

    @property
    def new_items(self) -> int:
        """Items the artifact did not have that ratings introduced (being folded in included)."""
        return len(self._items) - self.artifact.config.n_items

    def unseen(self, users: Sequence[str], items: Sequence[str]) -> tuple[set[str], set[str]]:
        """The user and item ids among these that neither the artifact nor any rating folded in (or being
        folded in) has: those a rating would add."""
        # Set comprehensions: `set - dict.keys()` would build a set of every key, per request.
        known_users, known_items = self._user_index, self._item_index
        return {u for u in users if u not in known_users}, {i for i in items if i not in known_items}

    def user_index(self, user: str, state: OnlineState | None = None) -> int | None:
        """The index of an external user id in `state` (default the published one), or None when it has no
        rating there (a user being folded in right now becomes known once its state is published; a user
        who arrived online and took every rating back is unknown again)."""
        i = self._user_index.get(user)
        state = state or self.state
        if i is None or i >= state.network.n_users or i in state.forgotten:
            return None
        if i >= self._base.n_users and not state.online.get(i):
            return None  # arrived online and took every rating back: none, as a replay of the compacted head
        return i

    def user_id(self, index: int) -> str:
        """The external id of a user index."""
        return self._users[index]

    def item_index(self, item: str, state: OnlineState | None = None) -> int | None:
        """The index of an external item id in `state` (default the published one; the artifact's items,
        then new ones), or None."""
        j = self._item_index.get(item)
        return j if j is not None and j < len((state or self.state).embedded) else None

    def item_indices(self, items: Sequence[str], state: OnlineState | None = None) -> IntArray:
        """`item_index` of each id, -1 where it is None: (K,) int64."""
        found = np.fromiter(map(self._item_index.get, items, repeat(-1)), dtype=np.int64, count=len(items))
        found[found >= len((state or self.state).embedded)] = -1
        return found

    def item_id(self, index: int) -> str:
        """The external id of an item index."""
        return self._items[index]

    def online_count(self, user: int, state: OnlineState | None = None) -> int:
        """How many items the user rated online, in `state` (default the published one)."""
        return len((state or self.state).online.get(user, ()))

    def online_items(self, user: int, state: OnlineState | None = None) -> list[int]:
        """The items the user rated online, in `state` (default the published one)."""
        return list((state or self.state).online.get(user, ()))

    def record(self, item: str, state: OnlineState | None = None) -> ItemRecord | None:
        """The item's catalogue record in `state` (default the published one): as online changes left it,
        else the artifact's; None where it has none."""
        online = (state or self.state).records
        return online[item] if item in online else (self.artifact.catalogue or {}).get(item)

    def apply(
        self,
        ratings: Sequence[tuple[str, str, float | None]],
        items: Sequence[tuple[str, ItemChange]] = (),
        dismissals: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Fold in (external user id, external item id, rating) triples, in order; later ones win. A rating
        None retracts the pair's rating (online or the artifact's); a pair of an unknown user or item has
        none to retract. (user, FORGET, None) forgets the user: every rating of theirs is taken back and the
        user is unknown to queries until a later rating of theirs. `items`: catalogue changes (item id,
        change), in order; ValueError (nothing applied) where one leaves a record past a limit.
        `dismissals`: (user, item) dismissals and (user, FORGET) forgets, in stream order (a forget drops
        the user's earlier dismissals)."""
        if not ratings and not items and not dismissals:
            return
        with self._lock:
            records = self._changed_records(items)  # checked before anything changes
            if ratings:
                undo = self._checkpoint()
                try:
                    self._apply(ratings, undo)
                except BaseException:  # nothing published: the next state is built whole or not at all
                    self._rollback(undo)
                    raise
            if records:
                old = self.state
                count = old.records_applied + len(items)
                self.state = replace(
                    old,
                    records={**old.records, **records},
                    record_versions={**old.record_versions, **dict.fromkeys(records, count)},
                    records_applied=count,
                    published=time.monotonic(),
                )
            if dismissals:
                self.state = _dismissed(self.state, dismissals)

    def _changed_records(self, items: Sequence[tuple[str, ItemChange]]) -> dict[str, ItemRecord]:
        """The records the changes leave, by item (the caller holds the lock); ValueError naming the item
        whose change breaks a limit."""
        out: dict[str, ItemRecord] = {}
        for item, change in items:
            try:
                out[item] = change.applied_to(out[item] if item in out else self.record(item))
            except ValueError as exc:
                raise ValueError(f"the catalogue change of item {item!r}: {exc}") from None
        return out

    def _checkpoint(self) -> _Checkpoint:
        """What `_apply` may change before it publishes a state (the caller holds the lock)."""
        return _Checkpoint(
            len(self._users),
            len(self._items),
            dict(self._online),  # the inner dicts are never changed, only replaced
            dict(self._new_items),
            set(self._forgotten),
            set(self._taken_back),
            self._embedded,
            self._bias,
            [],
        )

    def _rollback(self, undo: _Checkpoint) -> None:
        """Back to `undo` after a batch that failed half way (the caller holds the lock). The ids it added
        leave the vocabularies: no published state holds them (a state bounds the indexes it answers)."""
        for user in self._users[undo.n_users :]:
            del self._user_index[user]
        del self._users[undo.n_users :]
        for item in self._items[undo.n_items :]:
            del self._item_index[item]
        del self._items[undo.n_items :]
        self._online, self._new_items = undo.online, undo.new_items
        self._forgotten, self._taken_back = undo.forgotten, undo.taken_back
        self._embedded, self._bias = undo.embedded, undo.bias
        for positions in undo.kept:
            self._keep[positions] = True

    def _apply(self, ratings: Sequence[tuple[str, str, float | None]], undo: _Checkpoint) -> None:
        """`apply` (the caller holds the lock and rolls back on failure)."""
        m = self.artifact.config.n_items
        users: set[int] = set()
        items: set[int] = set()
        pairs: dict[tuple[int, int], float | None] = {}  # this batch's latest rating of each pair
        for user, item, value in ratings:
            if value is None and item == FORGET:
                self._forget(user, users, items, pairs)
                continue
            if value is None:
                self._retract(user, item, users, items, pairs)
                continue
            self._forgotten.discard(self._user_index.get(user, -1))  # rating again: known again
            i = self._user_index.get(user)
            if i is None:
                i = self._user_index[user] = len(self._users)
                self._users.append(user)
            j = self._item_index.get(item)
            if j is None:
                j = self._item_index[item] = len(self._items)
                self._items.append(item)
            # New dicts rather than changed ones: a request may be reading the old ones.
            self._online[i] = {**self._online.get(i, {}), j: float(value)}
            if j >= m:
                self._new_items[j] = {**self._new_items.get(j, {}), i: float(value)}
                items.add(j)
            users.add(i)
            pairs[i, j] = float(value)
        base = self._base
        for (i, j), value in pairs.items():  # the artifact's ratings re-rated or taken back now
            if i < base.n_users:
                hit = base.find(i, j)
                undo.kept.append(hit[self._keep[hit]])
                self._keep[hit] = False
                if value is None and len(hit):
                    self._taken_back.add(i)
        touched_users = np.array(sorted(users), dtype=np.int64)
        touched_items = np.array(sorted(items), dtype=np.int64)
        network, embedded_items, dropped, touched_users = self._network(touched_users, touched_items)
        known = self._known(pairs, embedded_items, dropped)
        self._refit_biases(touched_users, touched_items)
        old = self.state
        changed_items = np.union1d(embedded_items, dropped)
        scorer = old.scorer.updated(network, known, touched_users, changed_items)
        known = _same_known(scorer, known)
        applied = old.applied + len(ratings)
        items_changed = len(changed_items) > 0 or len(self._items) > len(old.embedded)
        scorer.prepare()  # what answers read for every user, before the state is served
        self.state = OnlineState(
            network,
            known,
            scorer,
            applied,
            self._embedded.copy(),
            self._bias,  # a new one per refit: never changed in place
            dict(self._online),  # the inner dicts are never changed, only replaced
            {**old.changed, **dict.fromkeys(touched_users.tolist(), applied)},
            applied if items_changed else old.items_changed,
            frozenset(self._forgotten),
            records=old.records,
            record_versions=old.record_versions,
            records_applied=old.records_applied,
            dismissed=old.dismissed,
            dismissals_applied=old.dismissals_applied,
        )

    def snapshot(self) -> tuple[int, bytes]:
        """The published state and what later ratings build on, as (writes, payload): an .npz of plain
        arrays (no pickles) that `restore` turns back into this state. What `apply` computes per rating
        (embeddings, refinements, biases, the known ratings in their order) is stored, so restoring costs
        one scorer update, not a replay; a later `apply` continues exactly as it would have here."""
        with self._lock:
            state = self.state
            known = state.known.compact()  # the ratings alone, one position each
            n, m = self.artifact.config.n_users, self.artifact.config.n_items
            online = _flat(self._online)
            new_items = _flat(self._new_items)
            changed = np.array(list(state.changed.items()), dtype=np.int64).reshape(-1, 2)
            ids = {"users": self._users[n:], "items": self._items[m:]}
            arrays = {
                "format": np.array(
                    [SNAPSHOT_FORMAT, state.applied, state.items_changed, n, m, len(self._base)]
                ),
                "ids": np.frombuffer(json.dumps(ids).encode(), dtype=np.uint8),
                "keep": self._keep,
                "online_users": np.array(list(self._online), dtype=np.int64),  # with those who have none
                "online_rows": online[0],
                "online_cols": online[1],
                "online_values": online[2],
                "new_item_cols": new_items[0],
                "new_item_rows": new_items[1],
                "new_item_values": new_items[2],
                "forgotten": np.array(sorted(self._forgotten), dtype=np.int64),
                "taken_back": np.array(sorted(self._taken_back), dtype=np.int64),
                "embedded": self._embedded,
                "mu": np.array([self._bias.mu]),
                "user_biases": self._bias.users,
                "item_biases": self._bias.items,
                "user_emb": np.asarray(state.network.user_emb),
                "item_emb": np.asarray(state.network.item_emb),
                "known_rows": known.rows,
                "known_cols": known.cols,
                "known_values": known.values,
                "changed": changed,
                "catalogue": np.frombuffer(
                    json.dumps(
                        {
                            "applied": state.records_applied,
                            "records": [
                                [item, record.to_json(), state.record_versions[item]]
                                for item, record in state.records.items()
                            ],
                        }
                    ).encode(),
                    dtype=np.uint8,
                ),
                "dismissed": np.frombuffer(
                    json.dumps(
                        {
                            "applied": state.dismissals_applied,
                            "users": [[user, sorted(items)] for user, items in state.dismissed.items()],
                        }
                    ).encode(),
                    dtype=np.uint8,
                ),
                **{f"scorer_{name}": value for name, value in state.scorer.online_tables().items()},
            }
            buffer = io.BytesIO()
            np.savez(buffer, allow_pickle=False, **arrays)
            return state.writes, buffer.getvalue()

    def restore(self, payload: bytes) -> int:
        """Take the state of a `snapshot` of this artifact's fold-in; returns how many online ratings and
        catalogue changes it includes (`OnlineState.writes`). Only a fold-in that has applied nothing yet
        can restore. Raises SnapshotError when the payload is of another layout or artifact, or its arrays
        do not fit together; this fold-in is then unchanged."""
        try:
            with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
                a = {name: npz[name] for name in npz.files}
            fmt, applied, items_changed, n, m, n_base = (int(x) for x in a["format"])
            ids = json.loads(a["ids"].tobytes().decode())
            catalogue = json.loads(a["catalogue"].tobytes().decode()) if "catalogue" in a else None
            dismissed = json.loads(a["dismissed"].tobytes().decode()) if "dismissed" in a else None
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
            raise SnapshotError(f"not a fold-in snapshot: {exc}") from exc
        if fmt != SNAPSHOT_FORMAT or catalogue is None or dismissed is None:
            raise SnapshotError(f"snapshot layout {fmt}, this code reads {SNAPSHOT_FORMAT}")
        try:
            records = {str(i): ItemRecord.model_validate(r) for i, r, _ in catalogue["records"]}
            versions = {str(i): int(v) for i, _, v in catalogue["records"]}
            records_applied = int(catalogue["applied"])
            dismissals = {str(u): frozenset(str(i) for i in items) for u, items in dismissed["users"]}
            dismissals_applied = int(dismissed["applied"])
        except (KeyError, TypeError, ValueError) as exc:  # pydantic's ValidationError too
            raise SnapshotError(f"the snapshot's catalogue cannot be read: {exc}") from None
        config = self.artifact.config
        if (n, m, n_base) != (config.n_users, config.n_items, len(self._base)):
            raise SnapshotError("the snapshot is of another artifact (its matrix or ratings differ)")
        users = self._users[:n] + [str(u) for u in ids["users"]]
        items = self._items[:m] + [str(j) for j in ids["items"]]
        try:
            with self._lock:
                if self.state.writes:
                    raise SnapshotError("only a fold-in that has applied nothing can restore")
                self._restore(a, users, items, applied, items_changed)
                self.state = replace(
                    self.state,
                    records=records,
                    record_versions=versions,
                    records_applied=records_applied,
                    dismissed=dismissals,
                    dismissals_applied=dismissals_applied,
                )
        except (KeyError, IndexError, ValueError) as exc:
            if isinstance(exc, SnapshotError):
                raise
            raise SnapshotError(f"the snapshot's arrays do not fit together: {exc}") from exc
        return self.state.writes

    def _restore(
        self, a: dict[str, np.ndarray], users: list[str], items: list[str], applied: int, items_changed: int
    ) -> None:
        """`restore` (the caller holds the lock): every field checked before any is replaced."""
        n_users, n_items = len(users), len(items)
        shapes = {
            "keep": (len(self._base),),
            "embedded": (n_items,),
            "user_biases": (n_users,),
            "item_biases": (n_items,),
            "user_emb": (n_users, self.state.network.user_emb.shape[1]),
            "item_emb": (n_items, self.state.network.item_emb.shape[1]),
        }
        for name, shape in shapes.items():
            if a[name].shape != shape:
                raise SnapshotError(f"{name} is {a[name].shape}, expected {shape}")
        if len(set(users)) != n_users or len(set(items)) != n_items:
            raise SnapshotError("repeated user or item ids")
        known = Ratings(a["known_rows"], a["known_cols"], a["known_values"], n_users, n_items)
        bounds = (
            ("online_users", n_users),
            ("online_rows", n_users),
            ("online_cols", n_items),
            ("new_item_rows", n_users),
        )
        for name, bound in bounds:
            if len(a[name]) and (a[name].min() < 0 or a[name].max() >= bound):
                raise SnapshotError(f"{name} outside the {n_users} x {n_items} matrix")
        if len(a["new_item_cols"]) and a["new_item_cols"].min() < self.artifact.config.n_items:
            raise SnapshotError("new_item_cols holds an item of the artifact")
        old = self.state
        online: dict[int, dict[int, float]] = {int(i): {} for i in a["online_users"].tolist()}
        rows, cols, values = a["online_rows"].tolist(), a["online_cols"].tolist(), a["online_values"].tolist()
        for i, j, r in zip(rows, cols, values, strict=True):
            online.setdefault(i, {})[j] = r
        new_items: dict[int, dict[int, float]] = {j: {} for j in range(self.artifact.config.n_items, n_items)}
        cols, rows, values = (
            a["new_item_cols"].tolist(),
            a["new_item_rows"].tolist(),
            a["new_item_values"].tolist(),
        )
        for j, i, r in zip(cols, rows, values, strict=True):
            new_items[j][i] = r
        changed = dict(zip(a["changed"][:, 0].tolist(), a["changed"][:, 1].tolist(), strict=True))
        embedded = a["embedded"].astype(bool)
        same = n_items == old.network.n_items
        network = Network(
            old.network.config,
            a["user_emb"],
            a["item_emb"],
            old.network.bilinear,
            old.network.item_table if same else None,
        )
        touched = np.array(sorted(changed), dtype=np.int64)
        new_embedded = np.flatnonzero(embedded[self.artifact.config.n_items :]) + self.artifact.config.n_items
        tables = {name[len("scorer_") :]: value for name, value in a.items() if name.startswith("scorer_")}
        scorer = old.scorer.updated(network, known, touched, new_embedded, tables=tables)
        known = _same_known(scorer, known)
        # Checked and built: now replace.
        self._users, self._items = users, items
        self._user_index = {user: i for i, user in enumerate(users)}
        self._item_index = {item: j for j, item in enumerate(items)}
        self._online, self._new_items = online, new_items
        self._keep = a["keep"].astype(bool)
        self._forgotten = set(a["forgotten"].tolist())
        self._taken_back = set(a["taken_back"].tolist())
        self._embedded = embedded
        self._bias = BiasModel(
            float(a["mu"][0]), a["user_biases"].copy(), a["item_biases"].copy(), USER_SHRINK, ITEM_SHRINK
        )
        scorer.prepare()  # what answers read for every user, before the state is served
        self.state = OnlineState(
            network,
            known,
            scorer,
            applied,
            embedded.copy(),
            self._bias,
            dict(online),
            changed,
            items_changed,
            frozenset(self._forgotten),
        )

    def _forget(
        self, user: str, users: set[int], items: set[int], pairs: dict[tuple[int, int], float | None]
    ) -> None:
        """Take every rating of the user back and mark the user forgotten (`apply`, holding the lock)."""
        i = self._user_index.get(user)
        if i is None:
            return
        rated = set(self._online.get(i, {})) | {j for (u, j), v in pairs.items() if u == i and v is not None}
        base = self._base
        if i < base.n_users:
            pos = base.by_row.of(i)
            rated |= set(base.cols[pos[self._keep[pos]]].tolist())
        for j in sorted(rated):
            self._retract(user, self._items[j], users, items, pairs)
        users.add(i)
        self._forgotten.add(i)

    def _retract(
        self,
        user: str,
        item: str,
        users: set[int],
        items: set[int],
        pairs: dict[tuple[int, int], float | None],
    ) -> None:
        """Take the user's rating of the item back (`apply`, the caller holds the lock)."""
        i, j = self._user_index.get(user), self._item_index.get(item)
        if i is None or j is None:
            return
        self._online[i] = {k: v for k, v in self._online.get(i, {}).items() if k != j}
        if j in self._new_items:
            self._new_items[j] = {k: v for k, v in self._new_items[j].items() if k != i}
            items.add(j)
        users.add(i)
        pairs[i, j] = None

    def _known(
        self, pairs: dict[tuple[int, int], float | None], embedded: IntArray, dropped: IntArray
    ) -> Ratings:
        """The CRF's known ratings: the artifact's less those re-rated online, then every online rating of
        an item that has an embedding. The published ones with this batch's `pairs` re-rated, taken back
        or added, the ratings of the items `embedded` just now added, and those of the items `dropped`
        (their embedding gone) taken out (`Ratings.changed`: no rebuild, so a batch costs what it changes,
        not all N ratings)."""
        changes = {pair: value for pair, value in pairs.items() if self._embedded[pair[1]]}
        for item in embedded.tolist():  # first embedded now: every online rating of it joins
            changes.update({(user, item): value for user, value in self._new_items[item].items()})
        old = self.state.known
        at, values, rows, cols, added, removed = [], [], [], [], [], []
        for item in dropped.tolist():
            if item < old.n_items:
                removed += old.by_col.of(item).tolist()
        for (user, item), value in changes.items():
            hit = old.find(user, item)
            if value is None:  # retracted
                removed += hit.tolist()
            elif len(hit):
                at.append(int(hit[0]))
                values.append(value)
            else:
                rows.append(user)
                cols.append(item)
                added.append(value)
        return old.changed(
            np.array(at, dtype=np.int64),
            np.array(values, dtype=np.float64),
            np.array(rows, dtype=np.int64),
            np.array(cols, dtype=np.int64),
            np.array(added, dtype=np.float64),
            len(self._users),
            len(self._items),
            np.array(removed, dtype=np.int64),
        )

    def _network(self, users: IntArray, items: IntArray) -> tuple[Network, IntArray, IntArray, IntArray]:
        """The network with the changed new items' embeddings recomputed by the column branch, then the
        changed users' by the row branch (rows grown for new users and items). A new item none of whose
        raters the model was trained on any more (retracted, forgotten) loses its embedding: it was made
        from those ratings, and the item is answered by the bias baseline again. A user who rated an item
        whose embedding changed is changed too (its refinement reads that embedding), so the state depends
        on the ratings alone, not on how they were batched. Returns (network, the items embedded, the items
        whose embedding was dropped, every user changed)."""
        old = self.state.network
        train = self.artifact.train
        n, m = train.n_users, train.n_items  # the branches' input widths
        self._embedded = np.concatenate(
            [self._embedded, np.zeros(len(self._items) - len(self._embedded), bool)]
        )
        # The items' table is copied only when it changes (rows for new items, or embeddings for them).
        same_items = not len(items) and len(self._items) == old.n_items
        item_emb = old.item_emb if same_items else _grown(old.item_emb, len(self._items))
        columns, embeddable, lost = [], [], []
        for item in items:
            raters = self._new_items[int(item)]
            by = np.fromiter(raters.keys(), dtype=np.int64, count=len(raters))
            trained = by < n  # the column branch reads the users the model was trained on
            if trained.any():
                column = np.zeros(n, dtype=np.float32)
                column[by[trained]] = np.fromiter(raters.values(), dtype=np.float32)[trained]
                columns.append(column)
                embeddable.append(int(item))
            elif self._embedded[int(item)]:
                lost.append(int(item))
        embedded = np.array(embeddable, dtype=np.int64)
        dropped = np.array(lost, dtype=np.int64)
        if len(dropped):
            item_emb[dropped] = 0.0
            self._embedded[dropped] = False
        if len(embedded):
            vectors = np.asarray(self._embed_cols(np.stack(columns)), np.float32)
            item_emb[embedded] = vectors.astype(np.float64)
            self._embedded[embedded] = True
        changed_items = np.union1d(embedded, dropped)
        if len(changed_items):  # their raters' refinements read those embeddings
            by_item = [np.fromiter(self._new_items[int(j)], dtype=np.int64) for j in changed_items]
            users = np.union1d(users, np.concatenate(by_item)).astype(np.int64)
        rows = np.zeros((len(users), m), dtype=np.float32)
        existing = users < n
        if existing.any():
            rows[existing] = train.dense_rows(users[existing])
        base = self._base
        for k, user in enumerate(users.tolist()):  # the artifact's ratings taken back: out of the row
            if user in self._taken_back:
                pos = base.by_row.of(user)
                gone = base.cols[pos[~self._keep[pos]]]
                gone = gone[(gone < m) & ~np.isin(gone, list(self._online.get(user, {})))]
                rows[k, gone] = 0.0
        for k, user in enumerate(users):
            ratings = self._online.get(int(user), {})
            cols = np.fromiter(ratings.keys(), dtype=np.int64, count=len(ratings))
            mine = cols < m
            rows[k, cols[mine]] = np.fromiter(ratings.values(), dtype=np.float32)[mine]
        user_emb = _grown(old.user_emb, len(self._users))
        user_emb[users] = np.asarray(self._embed_rows(rows), dtype=np.float32).astype(np.float64)
        stacked = self._stacked
        for user in users:  # the row branch's embedding, refined by the decoder's likelihood of the ratings
            if user < n and self._trained[user] and not self.refine_trained:
                continue
            items, values = self._ratings_of(int(user))
            if len(items):
                labels = nearest_level(values, old.levels)
                user_emb[user] = refine_embedding(
                    user_emb[user], item_emb[items], old.bilinear, labels, stacked=stacked
                )
        # The float32 catalogue that whole-catalogue reads take stays the old one while no item changed.
        same = not len(changed_items) and len(item_emb) == old.n_items
        table = old.item_table if same else None
        return old.with_rows(user_emb, item_emb, users, changed_items, table), embedded, dropped, users

    def _ratings_of(self, user: int) -> tuple[IntArray, np.ndarray]:
        """The user's known ratings of items with an embedding: the artifact's (less those re-rated), then
        the online ones."""
        ratings: dict[int, float] = {}
        base = self._base
        if user < base.n_users:
            pos = base.by_row.of(user)
            pos = pos[self._keep[pos]]
            ratings = dict(zip(base.cols[pos].tolist(), base.values[pos].tolist(), strict=True))
        ratings.update(self._online.get(user, {}))
        items = np.fromiter(ratings.keys(), dtype=np.int64, count=len(ratings))
        values = np.fromiter(ratings.values(), dtype=np.float64, count=len(ratings))
        keep = self._embedded[items]
        return items[keep], values[keep]

    def _refit_biases(self, users: IntArray, items: IntArray) -> None:
        """The baseline's biases of the changed users, from their ratings of the artifact's items (whose
        biases are the artifact's fit), then of the new items that changed or that a changed user rated
        (given the user biases): one exact ridge step each. Each bias so follows from the current ratings
        alone, not from the order they were folded in (a snapshot's tail folds in as a replay would)."""
        base, keep, m = self._base, self._keep, self.artifact.config.n_items
        touched = users.tolist()
        rated_new = {j for user in touched for j in self._online.get(user, {}) if j >= m}

        def artifact_items(user: int) -> tuple[IntArray, np.ndarray]:  # the user's ratings of them
            online = self._online.get(user, {})
            ratings = {}
            if user < base.n_users:
                pos = base.by_row.of(user)
                pos = pos[keep[pos]]
                ratings = dict(zip(base.cols[pos].tolist(), base.values[pos].tolist(), strict=True))
            ratings.update((j, v) for j, v in online.items() if j < m)
            cols = np.fromiter(ratings.keys(), dtype=np.int64, count=len(ratings))
            return cols, np.fromiter(ratings.values(), dtype=np.float64, count=len(ratings))

        def raters(item: int) -> tuple[IntArray, np.ndarray]:
            by = self._new_items[item]
            return (
                np.fromiter(by.keys(), dtype=np.int64, count=len(by)),
                np.fromiter(by.values(), dtype=np.float64, count=len(by)),
            )

        bias = self._bias.grown(len(self._users), len(self._items)).with_users(touched, artifact_items)
        self._bias = bias.with_items(sorted(rated_new.union(items.tolist())), raters)


def _same_known(scorer: Scorer, known: Ratings) -> Ratings:
    """The known ratings the scorer answers from: `known`, or the compacted copy it took (a scorer that
    recomputes its field reads the whole arrays), so that positions in its answers (explanations) are
    positions in the state's known ratings."""
    held = getattr(scorer, "known", None)
    return held if isinstance(held, Ratings) else known


def _flat(nested: Mapping[int, Mapping[int, float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """{a: {b: value}} as arrays (a, b, value) in the mappings' order (int64, int64, float64)."""
    a = [k for k, inner in nested.items() for _ in inner]
    b = [j for inner in nested.values() for j in inner]
    values = [v for inner in nested.values() for v in inner.values()]
    return np.array(a, dtype=np.int64), np.array(b, dtype=np.int64), np.array(values, dtype=np.float64)


def _grown(table: np.ndarray, rows: int) -> np.ndarray:
    """A float64 copy of `table` with zero rows appended up to `rows`."""
    out = np.zeros((rows, *table.shape[1:]))
    out[: len(table)] = table
    return out
