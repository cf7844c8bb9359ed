"""Training on the ratings that arrived online: `dcmc train --online-ratings redis://...`.

The service appends every acknowledged rating to the Redis stream `<prefix>:ratings` (entries in the
format of model/stream.py, read here by the same parser: an entry the service skips is skipped here).
Here the whole stream up to now is read (from its compacted head on, where `dcmc compact` trimmed it:
training/compact.py), a re-rating replacing the earlier one (as the service folds them), and added to the
dataset's training ratings:

- a new user or item gets the next index (its id appended to the dataset's, in order of first rating);
- a rating of a pair the dataset already rates in its training part replaces that rating;
- a retraction (DELETE /ratings) takes the pair's rating back: the online one, and the dataset's training
  and validation rating of the pair (validation ratings are known to the served model and refit on); its
  test part stays as it is (what the model is scored on, never served);
- forgetting a user (DELETE /users/{id}) drops every rating of the user before it, online and the
  dataset's, in every part (a privacy request outranks the evaluation); the id stays in the vocabulary
  without ratings, and the artifact lists it (`forgotten_users`) so that a service keeps it unknown.
  Ratings of the same id after it are a new history;
- a rating of a pair held out by the dataset (its test or validation part) is not trained on, so the
  held-out ratings stay unseen and the evaluation honest; the artifact keeps it (`held_out_pairs`) for the
  service, which folds it in as a known rating, as it did before the retrain (`dcmc evaluate` does not).

The artifact records the stream id of the last rating read (`dataset.online_ratings.last_id` in
config.json) and the stream's identity (`model.stream.identity_key`); a service that loads it replays only
the ratings after that id, from a stream of that identity (another stream of the same name: all of it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from model.catalogue import ItemChange, ItemRecord
from model.stream import (
    DISMISS,
    FORGET,
    Compacted,
    Entry,
    Event,
    ItemEntry,
    compacted_key,
    connect,
    explained_by_purge,
    head_last,
    identity_key,
    off_levels,
    parse_entry,
    read_page,
    redact_url,
    stream_key,
    text,
)
from training.data import DataError, Entries, RatingSplit

log = logging.getLogger(__name__)

PAGE = 10_000
"""Stream entries read per Redis call."""


@dataclass(frozen=True)
class OnlineRatings:
    """The stream's ratings, last one per (user, item), and where the stream was read up to."""

    users: list[str]
    items: list[str]
    values: np.ndarray
    last_id: str
    """Stream id of the last entry read ("0" for an empty stream)."""
    entries: int
    """Stream entries read (re-ratings included)."""
    key: str
    identity: str | None = None
    """The stream's identity (`model.stream.identity_key`), None where no service has set one."""
    retracted: tuple[tuple[str, str], ...] = ()
    """(user, item) pairs whose last stream entry is a retraction."""
    forgotten: tuple[str, ...] = ()
    """Users forgotten (their ratings before it are gone; `users` holds only their later ones)."""
    skipped: int = 0
    """Entries skipped as poison (as the service skips them)."""
    forgotten_now: tuple[str, ...] = ()
    """The forgotten users without a rating since their last forget: still forgotten (the artifact records
    them, so that the service keeps them unknown)."""
    item_changes: tuple[tuple[str, ItemChange], ...] = ()
    """Each item's catalogue changes (PUT/PATCH /items), composed into one, in the order of the items'
    first change."""
    dismissed: tuple[tuple[str, str], ...] = ()
    """(user, item) pairs dismissed (POST /events `dismiss`) since the user was last forgotten (other
    events are evaluation data: not read into training)."""


def stream_client(url: str, timeout_s: float) -> Any:
    """A client of the stream's Redis at `url` (`model.stream.connect`: a cluster where the URL says so);
    DataError for a URL whose `cluster` flag is neither true nor false."""
    try:
        return connect(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    except ValueError as exc:
        raise DataError(str(exc)) from None


READ_ATTEMPTS = 5
"""How often a read of the stream starts again when a compaction trims past it meanwhile."""

_HEAD = object()  # read_online_ratings: read the compacted head from Redis


def read_online_ratings(
    url: str,
    prefix: str = "dcmc",
    timeout_s: float = 10.0,
    levels: Sequence[float] | None = None,
    up_to: str | None = None,
    head: Any = _HEAD,
) -> OnlineRatings:
    """Every rating of the stream `<prefix>:ratings` at `url` (up to the id `up_to` when given), a
    re-rating replacing the earlier one, starting from the stream's compacted head where it has one
    (training/compact.py; `head`: its raw value as the caller read it, None for none); DataError when Redis
    cannot be read. An entry the service would not apply (`model.stream.parse_entry` says it is poison,
    or its rating is not one of `levels`) is skipped and counted, as the service skips it. A compaction
    that trims the stream past the read meanwhile makes it start again from the new head (at most
    READ_ATTEMPTS times), so no trimmed entry is skipped unknowingly."""
    import redis

    key = stream_key(prefix)
    client = stream_client(url, timeout_s)
    try:
        for _ in range(READ_ATTEMPTS):
            raw_head = client.get(compacted_key(key)) if head is _HEAD else head
            got = _read_once(client, key, raw_head, levels, up_to)
            if got is not None:
                return got
            if head is not _HEAD:
                raise DataError(f"the stream {key} was compacted past the given head meanwhile")
    except redis.RedisError as exc:
        raise DataError(f"cannot read the online ratings from {redact_url(url)} ({key}): {exc}") from None
    except ValueError as exc:  # a compacted head that does not parse: its ratings cannot be read
        raise DataError(f"the compacted head of {key} at {redact_url(url)} cannot be read: {exc}") from None
    finally:
        client.close()
    raise DataError(f"the stream {key} kept being compacted during {READ_ATTEMPTS} reads; try again")


def _read_once(
    client: Any, key: str, head_raw: Any, levels: Sequence[float] | None, up_to: str | None
) -> OnlineRatings | None:
    """`read_online_ratings` from the head `head_raw`, or None when a compaction trimmed the stream past
    the read (start again)."""
    latest: dict[tuple[str, str], float] = {}
    retracted: dict[tuple[str, str], None] = {}
    forgotten: dict[str, None] = {}
    rated_since: set[str] = set()  # forgotten users with a rating after their last forget: known again
    changes: dict[str, ItemChange] = {}  # item -> its catalogue changes so far, composed
    dismissed: dict[tuple[str, str], None] = {}
    last, count, skipped = "0", 0, 0
    raw: Any = client.get(identity_key(key))
    identity = text(raw) if raw is not None else None
    head = None if head_raw is None else Compacted.from_json(head_raw)
    started = head.last if head is not None else None  # whatever its stream: a new head changes it
    if head is not None and head.identity != identity:
        log.warning("ignoring the compacted head of %s: it is of another stream of that name", key)
        head = None
    if head is not None:  # the entries it consolidates are trimmed from the stream
        latest = {(u, i): r for u, i, r in head.ratings}
        retracted = dict.fromkeys(head.retracted)
        forgotten = dict.fromkeys(head.forgotten)
        rated_since = {u for u, _ in latest if u in forgotten}
        changes = dict(head.items)
        dismissed = dict.fromkeys(head.dismissed)
        last = head.last
        count = len(head.ratings) + len(head.retracted) + len(head.forgotten) + len(head.items)
        count += len(head.dismissed)
    while True:
        page = read_page(client, key, last, PAGE, up_to or "+")
        if head_last(client, key) != started:
            return None  # a compaction wrote its head (and may have trimmed past this read): start again
        if page.deleted_after(last) and not explained_by_purge(client, key, page):
            log.error(
                "entries of %s after %s were deleted (up to %s), not by compaction nor by forgetting a "
                "user: they are lost",
                key,
                last,
                page.max_deleted,
            )
        if not page.entries:
            break
        parsed = [parse_entry(i, f) for i, f in page.entries]
        entries = [e for e in parsed if isinstance(e, Entry | Event)]
        for change in (e for e in parsed if isinstance(e, ItemEntry)):
            held = changes.get(change.item)
            try:
                changes[change.item] = change.change if held is None else held.then(change.change)
            except ValueError as exc:  # a whole record past a limit: the service skips it too
                log.warning("skipping the catalogue change %s of item %r: %s", change.id, change.item, exc)
                skipped += 1
        catalogue = sum(1 for e in parsed if isinstance(e, ItemEntry))
        ratings = [e for e in entries if isinstance(e, Entry)]
        refused = {p.id for p in off_levels(ratings, levels)} if levels is not None else set()
        skipped += len(parsed) - len(entries) - catalogue + len(refused)
        for entry in entries:
            if entry.id in refused:
                continue
            if isinstance(entry, Event):
                if entry.kind == DISMISS:
                    dismissed[(entry.user, entry.item)] = None
                continue
            if entry.item == FORGET and entry.rating is None:  # every earlier rating of the user is gone
                gone = entry.user
                latest = {p: v for p, v in latest.items() if p[0] != gone}
                retracted = {p: None for p in retracted if p[0] != gone}
                dismissed = {p: None for p in dismissed if p[0] != gone}
                forgotten[gone] = None
                rated_since.discard(gone)
                continue
            pair = (entry.user, entry.item)
            latest.pop(pair, None)  # a re-rating moves to the end: the order of last ratings
            if entry.rating is not None:
                latest[pair] = entry.rating
                retracted.pop(pair, None)
                if entry.user in forgotten:
                    rated_since.add(entry.user)
            else:  # a retraction
                retracted[pair] = None
        last, count = page.entries[-1][0], count + len(page.entries)
    if skipped:
        log.warning("skipped %d stream entries that the service does not apply either (poison)", skipped)
    pairs = list(latest)
    return OnlineRatings(
        users=[u for u, _ in pairs],
        items=[i for _, i in pairs],
        values=np.array([latest[p] for p in pairs], dtype=np.float64),
        last_id=last,
        entries=count,
        key=key,
        identity=identity,
        retracted=tuple(retracted),
        forgotten=tuple(forgotten),
        skipped=skipped,
        forgotten_now=tuple(u for u in forgotten if u not in rated_since),
        item_changes=tuple(changes.items()),
        dismissed=tuple(dismissed),
    )


def with_item_changes(
    catalogue: dict[str, ItemRecord] | None, online: OnlineRatings
) -> tuple[dict[str, ItemRecord] | None, int]:
    """The catalogue as the stream's catalogue changes leave it (each applied to the item's record, as the
    service applies them), and how many changes were skipped because they would break a limit."""
    if not online.item_changes:
        return catalogue, 0
    out = dict(catalogue or {})
    skipped = 0
    for item, change in online.item_changes:
        try:
            out[item] = change.applied_to(out.get(item))
        except ValueError as exc:
            log.warning("the online catalogue change of item %r is skipped: %s", item, exc)
            skipped += 1
    log.info("catalogue: %d items changed online", len(online.item_changes) - skipped)
    return out, skipped


def with_online(data: RatingSplit, online: OnlineRatings) -> tuple[RatingSplit, dict[str, Any]]:
    """`data` with the online ratings in its training part (module docstring), and the record of it for
    the artifact. DataError for a rating off the dataset's rating levels."""
    levels = np.asarray(data.levels, dtype=np.float64)
    off = ~np.isin(online.values, levels)
    if off.any():
        k = int(np.flatnonzero(off)[0])
        raise DataError(
            f"online rating {online.values[k]!r} of ({online.users[k]!r}, {online.items[k]!r}) is not one "
            f"of the dataset's levels {levels.tolist()}"
        )
    user_ids, item_ids = list(data.user_ids), list(data.item_ids)
    user_index = {u: i for i, u in enumerate(user_ids)}
    item_index = {j: i for i, j in enumerate(item_ids)}
    rows = np.array([user_index.setdefault(u, len(user_index)) for u in online.users], dtype=np.int64)
    cols = np.array([item_index.setdefault(j, len(item_index)) for j in online.items], dtype=np.int64)
    user_ids += list(user_index)[len(user_ids) :]
    item_ids += list(item_index)[len(item_ids) :]
    width = max(len(item_ids), 1)
    held = [e for e in (data.val, data.test) if e is not None]
    held_keys = np.concatenate([e.rows * width + e.cols for e in held]) if held else np.empty(0, np.int64)
    keys = rows * width + cols
    kept = ~np.isin(keys, held_keys)
    train = data.train
    train_keys = train.rows * width + train.cols
    gone = [
        user_index[u] * width + item_index[i]
        for u, i in online.retracted
        if u in user_index and i in item_index
    ]
    taken_back = np.isin(train_keys, np.array(gone, dtype=np.int64))
    replaced = np.isin(train_keys, keys[kept]) | taken_back
    erased = np.array([user_index[u] for u in online.forgotten if u in user_index], dtype=np.int64)
    later = np.isin(rows, erased) & kept  # ratings the user gave after being forgotten stay
    forgotten_train = np.isin(train.rows, erased) & ~np.isin(train_keys, keys[later])
    replaced |= forgotten_train
    erased_held = retracted_val = 0
    parts = {}
    gone_keys = np.array(gone, dtype=np.int64)
    for name in ("val", "test"):
        part = getattr(data, name)
        if part is None:
            continue
        drop = np.isin(part.rows, erased)
        erased_held += int(drop.sum())
        if name == "val":  # validation ratings become known ones (and refit data): a retraction holds
            taken = np.isin(part.rows * width + part.cols, gone_keys) & ~drop
            retracted_val = int(taken.sum())
            drop |= taken
        if drop.any():
            parts[name] = Entries(part.rows[~drop], part.cols[~drop], part.values[~drop])
    merged = Entries(
        np.concatenate([train.rows[~replaced], rows[kept]]),
        np.concatenate([train.cols[~replaced], cols[kept]]),
        np.concatenate([train.values[~replaced], online.values[kept]]),
    )
    out = ~kept  # held-out pairs: kept for the service, not trained on
    record = {
        "stream": online.key,
        "stream_identity": online.identity,
        "last_id": online.last_id,
        "stream_entries": online.entries,
        "skipped_entries": online.skipped,
        "ratings": int(kept.sum()),
        "replaced_training_ratings": int((replaced & ~taken_back).sum()),
        "retracted_training_ratings": int(taken_back.sum()),
        "retracted_validation_ratings": retracted_val,
        "retractions": len(online.retracted),
        "forgotten_users": list(online.forgotten_now),
        "forgotten_requests": len(online.forgotten),
        "forgotten_ratings": int((forgotten_train & ~taken_back).sum()) + erased_held,
        "left_out_held_out": int((~kept).sum()),
        "new_users": len(user_ids) - len(data.user_ids),
        "new_items": len(item_ids) - len(data.item_ids),
        "held_out_pairs": [
            [online.users[k], online.items[k], float(online.values[k])] for k in np.flatnonzero(out)
        ],
    }
    log.info(
        "online ratings: %d added (%d replacing training ratings, %d of held-out pairs left out), %d new "
        "users, %d new items, stream read up to %s (held-out pairs' ratings kept for the service)",
        record["ratings"],
        record["replaced_training_ratings"],
        record["left_out_held_out"],
        record["new_users"],
        record["new_items"],
        online.last_id,
    )
    return replace(data, user_ids=user_ids, item_ids=item_ids, train=merged, **parts), record
