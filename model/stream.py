"""The Redis rating stream as the service writes it and the trainer reads it: its key, its identity, the
format of its entries (written by `entry_fields`, read by `parse_entry`), and how a Redis URL is shown in
logs and messages (never with its password).

An entry is one of

    {user, item, rating}    a rating (a later one of the same pair replaces it)
    {user, item, retract}   the user took the rating of the item back (DELETE /ratings)
    {user, forget}          forget the user: every rating of theirs before it is gone (DELETE /users/{id})
    {item, record}          the item's catalogue record, whole (PUT /items/{id}; JSON, model/catalogue.py)
    {item, patch}           a change to part of it (PATCH /items/{id}; a JSON merge patch)
    {user, item, event}     an interaction that is not a rating (POST /events: `click`, `view`, `dismiss`,
                            ...); `dismiss` keeps the item out of the user's lists

A rating or an event may also carry `rec`, the recommendation id of the answer it follows (evaluation
reads it: model/experiments.py; the model does not).

with external ids of 1 to MAX_ID_LENGTH characters. Anything else is poison: the service skips it (and
copies it to the dead-letter stream), and so does the trainer. Ratings and catalogue changes share the one
stream, so both are durable, ordered, replicated, compacted and snapshotted by the same code.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

if TYPE_CHECKING:
    from model.catalogue import ItemChange

HIDDEN = "***"
"""What a password is shown as."""

MAX_ID_LENGTH = 256
"""Longest external user or item id, in characters (the API refuses longer ones with 422)."""

FORGET = ""
"""The item of an Entry that forgets its user (`(user, FORGET, None)`; no item id is empty)."""

RETRACT = "retract"
"""The stream field that marks a retraction (in place of `rating`)."""

FORGET_FIELD = "forget"
"""The stream field that marks forgetting a user (in place of `item` and `rating`)."""

RECORD, PATCH = "record", "patch"
"""The stream fields of a catalogue change (with `item`): the whole record, or a merge patch (JSON)."""

EVENT, REC = "event", "rec"
"""The stream field of an event's kind (with `user` and `item`), and of the recommendation id a rating or
an event names."""

DISMISS = "dismiss"
"""The event that keeps an item out of the user's lists from then on (until the user is forgotten)."""

EVENT_KIND = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
"""What an event's kind looks like: `click`, `view`, `dismiss`, `add-to-cart`, ..."""

REC_ID = re.compile(r"^[0-9a-f]{32}$")
"""What a recommendation id looks like (service/impressions.py makes them)."""


@dataclass(frozen=True)
class Entry:
    """One stream entry as applied: stream id, external user and item ids, rating; None for a retraction,
    and item FORGET with rating None to forget the user."""

    id: str
    user: str
    item: str
    rating: float | None

    def fields(self) -> dict[str, str]:
        """Its stream fields, as the dead-letter stream shows a refused entry's."""
        return entry_fields(self.user, self.item, self.rating)


@dataclass(frozen=True)
class ItemEntry:
    """One catalogue change as applied: stream id, external item id, the change (model/catalogue.py)."""

    id: str
    item: str
    change: ItemChange

    def fields(self) -> dict[str, str]:
        """Its stream fields."""
        return item_fields(self.item, self.change)


@dataclass(frozen=True)
class Event:
    """One event as applied: stream id, external user and item ids, its kind (`EVENT_KIND`), and the
    recommendation id it names (None for none)."""

    id: str
    user: str
    item: str
    kind: str
    rec: str | None = None

    def fields(self) -> dict[str, str]:
        """Its stream fields."""
        return event_fields(self.user, self.item, self.kind, self.rec)


@dataclass(frozen=True)
class Poison:
    """A stream entry that cannot be applied (a missing field, a bad value): skipped, copied to the
    dead-letter stream, counted and reported."""

    id: str
    fields: dict[str, str]
    reason: str


def entry_fields(user: str, item: str, rating: float | None, rec: str | None = None) -> dict[str, str]:
    """A stream entry's fields: {user, item, rating} (with `rec`, the recommendation id it answers, where
    given), {user, item, retract} for a retraction, or {user, forget} to forget the user (item FORGET)."""
    if rating is None and item == FORGET:
        return {"user": user, FORGET_FIELD: "1"}
    if rating is None:
        return {"user": user, "item": item, RETRACT: "1"}
    fields = {"user": user, "item": item, "rating": repr(float(rating))}
    if rec is not None:
        fields[REC] = rec
    return fields


def event_fields(user: str, item: str, kind: str, rec: str | None = None) -> dict[str, str]:
    """An event's stream fields: {user, item, event} and `rec` where given."""
    fields = {"user": user, "item": item, EVENT: kind}
    if rec is not None:
        fields[REC] = rec
    return fields


def item_fields(item: str, change: ItemChange) -> dict[str, str]:
    """A catalogue change's stream fields: {item, record} or {item, patch}."""
    ((kind, value),) = change.to_json().items()
    return {"item": item, kind: json.dumps(value, ensure_ascii=False, separators=(",", ":"))}


def _item_entry(eid: str, f: dict[str, str], shown: dict[str, str]) -> ItemEntry | Poison:
    from model.catalogue import ItemChange  # model.catalogue reads this module's limits

    if "user" in f or (RECORD in f and PATCH in f):
        return Poison(eid, shown, "a catalogue change has an item and one of record, patch; nothing else")
    if not 0 < len(f.get("item", "")) <= MAX_ID_LENGTH:
        return Poison(eid, shown, f"a catalogue change needs an item id of 1 to {MAX_ID_LENGTH} characters")
    kind = RECORD if RECORD in f else PATCH
    try:
        change = ItemChange.from_json({kind: json.loads(f[kind])})
    except ValueError as exc:  # json.JSONDecodeError too
        return Poison(eid, shown, f"catalogue {kind}: {exc}")
    return ItemEntry(eid, f["item"], change)


def _event(eid: str, f: dict[str, str], shown: dict[str, str]) -> Event | Poison:
    for name in ("user", "item"):
        if not 0 < len(f.get(name, "")) <= MAX_ID_LENGTH:
            return Poison(eid, shown, f"an event needs a {name} id of 1 to {MAX_ID_LENGTH} characters")
    if not EVENT_KIND.match(f[EVENT]):
        return Poison(eid, shown, "an event kind is 1 to 32 of a-z, 0-9, _ and -, starting with a letter")
    rec = f.get(REC)
    if rec is not None and not REC_ID.match(rec):
        return Poison(eid, shown, "a recommendation id is 32 hex digits")
    return Event(eid, f["user"], f["item"], f[EVENT], rec)


def parse_entry(entry_id: bytes | str, fields: dict[Any, Any]) -> Entry | ItemEntry | Event | Poison:
    """A stream entry (its id and fields, as Redis returns them) as an Entry (a rating, retraction or
    forget), an ItemEntry (a catalogue change), an Event, or as Poison saying what is wrong with it."""
    eid = text(entry_id)
    decoded = {_text_or_none(k): _text_or_none(v) for k, v in fields.items()}
    f = {k: v for k, v in decoded.items() if k is not None and v is not None}
    shown = {k: v[:MAX_ID_LENGTH] for k, v in f.items()}
    if len(f) != len(decoded) or None in decoded.values():
        return Poison(eid, shown, "a field that is not UTF-8")
    if RECORD in f or PATCH in f:
        return _item_entry(eid, f, shown)
    if EVENT in f:
        return _event(eid, f, shown)
    if FORGET_FIELD in f and "user" in f and 0 < len(f["user"]) <= MAX_ID_LENGTH:
        return Entry(eid, f["user"], FORGET, None)
    missing = [name for name in ("user", "item") if name not in f]
    if "rating" not in f and RETRACT not in f:
        missing.append("rating")
    if missing:
        return Poison(eid, shown, f"no {', '.join(missing)} field")
    for name in ("user", "item"):
        if not 0 < len(f[name]) <= MAX_ID_LENGTH:
            return Poison(eid, shown, f"{name} id of {len(f[name])} characters (1 to {MAX_ID_LENGTH})")
    if "rating" not in f:
        return Entry(eid, f["user"], f["item"], None)
    try:
        rating = float(f["rating"])
    except ValueError:
        return Poison(eid, shown, "rating is not a number")
    if not math.isfinite(rating):
        return Poison(eid, shown, "rating is not finite")
    return Entry(eid, f["user"], f["item"], rating)


def off_levels(entries: list[Entry], levels: Any) -> list[Poison]:
    """The ratings among `entries` that are not one of the model's `levels` (within 1e-9), as Poison."""
    levels = np.asarray(levels, dtype=np.float64)
    ratings = np.fromiter(
        (levels[0] if e.rating is None else e.rating for e in entries),  # a retraction or forget: no level
        dtype=np.float64,
        count=len(entries),
    )
    on_level = np.isclose(ratings[:, None], levels[None, :], rtol=0, atol=1e-9).any(axis=1)
    return [
        Poison(e.id, e.fields(), "rating off the levels")
        for e, ok in zip(entries, on_level.tolist(), strict=True)
        if not ok
    ]


@dataclass(frozen=True)
class Compacted:
    """The stream's entries up to `last`, consolidated as a replay leaves them: the users forgotten, the
    pairs whose last entry took the rating back, each pair's latest rating (in the order of those
    ratings), and each item's catalogue change. Folding in `entries()` and `items` gives the state the
    original entries gave (as a replay's state depends on the ratings, not on their batches)."""

    last: str
    identity: str | None
    ratings: tuple[tuple[str, str, float], ...]
    retracted: tuple[tuple[str, str], ...]
    forgotten: tuple[str, ...]
    items: tuple[tuple[str, ItemChange], ...] = ()
    """Each changed item's catalogue changes, composed into one (`ItemChange.then`), in the order of the
    items' first change."""
    dismissed: tuple[tuple[str, str], ...] = ()
    """(user, item) pairs dismissed (`DISMISS` events) since the user was last forgotten. Other events
    are evaluation data: compaction drops them."""

    def entries(self) -> list[tuple[str, str, float | None]]:
        """(user, item, rating) triples to fold in: forgets, then retractions, then ratings."""
        out: list[tuple[str, str, float | None]] = [(user, FORGET, None) for user in self.forgotten]
        out += [(user, item, None) for user, item in self.retracted]
        return out + [(user, item, rating) for user, item, rating in self.ratings]

    def to_json(self) -> str:
        """As stored in Redis."""
        return json.dumps(
            {
                "format": 1,
                "last": self.last,
                "identity": self.identity,
                "ratings": self.ratings,
                "retracted": self.retracted,
                "forgotten": self.forgotten,
                "items": [[item, change.to_json()] for item, change in self.items],
                "dismissed": self.dismissed,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> Compacted:
        """Inverse of `to_json`; ValueError for anything else."""
        from model.catalogue import ItemChange

        try:
            d = json.loads(raw)
            if d.get("format") != 1:
                raise ValueError(f"compacted head of format {d.get('format')!r}")
            return cls(
                str(d["last"]),
                None if d["identity"] is None else str(d["identity"]),
                tuple((str(u), str(i), float(r)) for u, i, r in d["ratings"]),
                tuple((str(u), str(i)) for u, i in d["retracted"]),
                tuple(str(u) for u in d["forgotten"]),
                tuple((str(i), ItemChange.from_json(c)) for i, c in d.get("items", ())),  # older heads: none
                tuple((str(u), str(i)) for u, i in d.get("dismissed", ())),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a compacted head: {exc}") from None


READ_SCRIPT = """
local entries = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', ARGV[3])
if redis.call('EXISTS', KEYS[1]) == 0 then return {entries, false, false} end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local deleted, generated = false, false
for i = 1, #info, 2 do
  if info[i] == 'max-deleted-entry-id' then deleted = info[i + 1] end
  if info[i] == 'last-generated-id' then generated = info[i + 1] end
end
return {entries, deleted, generated}
"""
"""`read_page`: entries after an id and the stream's max-deleted-entry-id and last-generated-id, in one atomic
step (one key: it runs on Redis Cluster as it is)."""


@dataclass(frozen=True)
class Page:
    """One read of the stream: the raw entries after an id (id, {field: value}), and at that instant the
    newest id ever deleted from it by XDEL and the newest ever added (None: no stream, or a Redis older than
    7.0, which does not keep the first). Redis does not count what XTRIM removes there: a compaction's
    trim is found by its head instead (`head_last`), which it writes first."""

    entries: list[tuple[str, dict[Any, Any]]]
    max_deleted: str | None
    last_generated: str | None

    def deleted_after(self, position: str) -> bool:
        """Whether an entry after `position` was deleted (XDEL) before this read: a forgotten user's
        purged entries (`explained_by_purge`), or entries deleted by hand."""
        return self.max_deleted is not None and stream_order(self.max_deleted) > stream_order(position)


MARK_SCRIPT = """
local function order(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local current = redis.call('GET', KEYS[1])
if current then
  local a, b = order(current)
  local c, d = order(ARGV[1])
  if a > c or (a == c and b >= d) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""
"""Raise the purge mark (`purged_key`) to the id ARGV[1] if it is below it."""


def purged_key(stream: str) -> str:
    """The key holding the newest stream id deleted by forgetting a user (the purge mark): set before the
    deletion, so that a reader who sees an entry after its place deleted can tell that purge (the
    forgotten user's earlier entries, nothing it needs) from a trim (`explained_by_purge`)."""
    return f"{stream}:purged"


def mark_purged(client: Any, stream: str, up_to: str) -> None:
    """Raise the purge mark of `stream` to `up_to` (before deleting entries up to it)."""
    client.eval(MARK_SCRIPT, 1, purged_key(stream), up_to)


def explained_by_purge(client: Any, stream: str, page: Page) -> bool:
    """Whether what `page` says was deleted is no later than the purge mark: deleted by forgetting a user,
    not trimmed. Raises redis.RedisError."""
    mark = client.get(purged_key(stream))
    if mark is None or page.max_deleted is None:
        return False
    return stream_order(text(mark)) >= stream_order(page.max_deleted)


def read_page(client: Any, key: str, after: str, count: int, up_to: str = "+") -> Page:
    """The stream `key`'s entries after the id `after` ("0": from the start) up to `up_to`, at most
    `count`, with what was deleted and added (READ_SCRIPT). Raises redis.RedisError."""
    start = f"({after}" if after != "0" else "-"
    raw, deleted, generated = client.eval(READ_SCRIPT, 1, key, start, up_to, count)
    entries = [(text(i), dict(zip(f[::2], f[1::2], strict=True))) for i, f in raw]

    def shown(value: Any) -> str | None:
        return None if value is None or value is False else text(value)

    return Page(entries, shown(deleted), shown(generated))


HEAD_LAST = re.compile(r'^\{"format": 1, "last": "([0-9]+-[0-9]+)"')
"""A compacted head's `last`, read from the start of its JSON (`Compacted.to_json` writes it second)."""


def head_last(client: Any, stream: str) -> str | None:
    """The `last` of the stream's compacted head, read from its first bytes alone (a head can hold
    megabytes): None where there is no head. A head whose start is not as `Compacted.to_json` writes it
    is read whole (ValueError when it is no head at all). Raises redis.RedisError."""
    raw = client.getrange(compacted_key(stream), 0, 127)
    if not raw:
        return None
    match = HEAD_LAST.match(text(raw))
    if match:
        return match.group(1)
    whole = client.get(compacted_key(stream))
    return None if whole is None else Compacted.from_json(whole).last


def after(entry_id: str) -> str:
    """The smallest stream id after `entry_id` ("ms-seq" -> "ms-(seq+1)"): XTRIM MINID of it removes the
    entries up to `entry_id`."""
    ms, seq = stream_order(entry_id)
    return f"{ms}-{seq + 1}"


def stream_order(entry_id: str) -> tuple[int, int]:
    """A stream id "ms-seq" as a pair that sorts as Redis orders ids."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def text(value: bytes | str) -> str:
    """A Redis reply's bytes as text (UTF-8)."""
    return value.decode() if isinstance(value, bytes) else value


def _text_or_none(value: bytes | str) -> str | None:
    try:
        return text(value)
    except UnicodeDecodeError:
        return None


def stream_key(prefix: str) -> str:
    """The stream of online ratings under the key prefix `prefix` (DCMC_REDIS_KEY_PREFIX)."""
    return f"{prefix}:ratings"


def compacted_key(stream: str) -> str:
    """The key holding the stream's compacted head (`dcmc compact`): every entry up to an id, consolidated
    (`Compacted`), the entries themselves trimmed from the stream."""
    return f"{stream}:compacted"


def identity_key(stream: str) -> str:
    """The key holding the stream's identity: a random id the service sets once (SET NX) when it first
    follows the stream, so that an artifact can tell this stream from another of the same name (another
    Redis, or the same one emptied and begun again)."""
    return f"{stream}:identity"


def redact_url(url: str) -> str:
    """`url` with its password, in the user part or as a `password=` query parameter, shown as ***:
    redis://:s3cret@redis:6379/0 -> redis://:***@redis:6379/0. Whatever cannot be parsed is shown as a
    placeholder, never as itself."""
    try:
        parts = urlsplit(url)
        password = parts.password
        netloc = parts.netloc
        if password is not None:
            user = parts.username or ""
            host = netloc.rpartition("@")[2]
            netloc = f"{user}:{HIDDEN}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, HIDDEN if k.lower() == "password" else v) for k, v in pairs], safe="*")
        if "://" not in url:
            return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
        shown = f"{parts.scheme}://{netloc}{parts.path}"
        return shown + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    except ValueError:
        return "<a Redis URL that cannot be parsed>"


CLUSTER_PARAM = "cluster"
"""The query parameter of a Redis URL that names one node of a Redis Cluster (`?cluster=true`)."""


def cluster_url(url: str) -> tuple[str, bool]:
    """(`url` without the `cluster` query parameter, whether it said true). ValueError for a value other
    than true/false/yes/no/1/0."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    flags = [v.strip().lower() for k, v in pairs if k == CLUSTER_PARAM]
    for flag in flags:
        if flag not in ("true", "false", "yes", "no", "1", "0"):
            raise ValueError(f"{redact_url(url)}: {CLUSTER_PARAM}={flag!r} is not true or false")
    rest = urlencode([(k, v) for k, v in pairs if k != CLUSTER_PARAM])
    plain = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment))
    return plain, bool(flags) and flags[-1] in ("true", "yes", "1")


def connect(url: str, **options: Any) -> Any:
    """A Redis client of `url` with `options` (socket timeouts, retry): redis.Redis, or where the URL ends
    in `?cluster=true` (one node of a Redis Cluster) a client that sends each command to the shard holding
    its key (redis.cluster.RedisCluster). Every command the service and the trainer send touches one key,
    and a transaction one key, so they run on a cluster as they are. The cluster client connects on its
    first command, as redis.Redis does: a service starts while Redis is down and waits for it."""
    import redis

    plain, cluster = cluster_url(url)
    if not cluster:
        return redis.Redis.from_url(plain, **options)
    return _Cluster(plain, options)


class _Cluster:
    """redis.cluster.RedisCluster made on first use. A cluster it cannot reach, or one that is down, raises
    redis.ConnectionError (what every caller handles as "Redis is unavailable") whatever the command: the
    cluster client's own RedisClusterException (unreachable, a slot not covered) is not a RedisError, and
    its ClusterDownError and TryAgainError are ResponseErrors, which callers read as a refused command. The
    next command tries again."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self._url, self._options = url, options
        self._client: Any = None

    def _connected(self) -> Any:
        if self._client is None:
            import redis
            from redis.cluster import RedisCluster
            from redis.exceptions import RedisClusterException

            try:
                self._client = RedisCluster.from_url(self._url, **self._options)
            except RedisClusterException as exc:  # nothing was sent: no node answered
                raise redis.ConnectionError(
                    f"connecting to Redis Cluster at {redact_url(self._url)}: {exc}"
                ) from None
        return self._client

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._connected(), name)
        if not callable(value):
            return value
        return _unavailable_as_connection_error(value, self._url)

    def close(self) -> None:
        """Release the connections (nothing when it never connected)."""
        if self._client is not None:
            self._client.close()


def _unavailable_as_connection_error(call: Any, url: str) -> Any:
    """`call`, raising redis.ConnectionError where the cluster is unreachable or down (`_Cluster`); a
    pipeline it returns does the same on `execute`."""
    import functools

    import redis
    from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError

    @functools.wraps(call)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            out = call(*args, **kwargs)
        except (ClusterDownError, TryAgainError) as exc:  # the server's reply: the command did not run
            raise redis.ConnectionError(
                f"Redis Cluster at {redact_url(url)} refused the command: {exc}"
            ) from None
        except RedisClusterException as exc:  # no node answered: the command may have run before
            raise redis.ConnectionError(f"Redis Cluster at {redact_url(url)}: {exc}") from None
        if hasattr(out, "execute") and hasattr(out, "command_stack"):  # a pipeline
            out.execute = _unavailable_as_connection_error(out.execute, url)
        return out

    return wrapped
