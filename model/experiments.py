"""Experiments on live traffic: how they are declared, who gets which variant, how two variants are
interleaved, and what their results are, computed from the streams the service writes.

**Declaring.** A TOML file (`DCMC_EXPERIMENTS`; docker/experiments.toml is a commented example) holds
`[[experiment]]` tables: `id`, `salt`, `share` of users in it, an optional `start`/`end`, `method` (`ab`:
each user sees one variant's list; `interleave`: each user sees the two variants' lists merged by team
draft), and two or more `[[experiment.variant]]` tables: `name`, `weight`, and what the variant changes:
`artifact` (another artifact directory), `inference` (overrides of the artifact's inference settings by
dotted name, as `dcmc serve` takes them: `"mode" = "none"`), `ranking` (/recommend's options: `diversity`,
`min_rating`, `filter`, `boosts`, or `popular = true` for the popular list). The first variant is the
control that differences are measured against.

**Assignment.** `unit(experiment, salt, user)` is a keyed BLAKE2b hash of the user under the experiment
and its salt, read as two numbers in [0, 1): the first puts a `share` of users in the experiment, the
second picks a variant by weight (the key: BLAKE2b of the salt, so a salt of any length counts whole).
It is the same in every worker, replica and restart (never Python's per-process `hash`), and changing
the salt reshuffles the users.

**Results** (`results`): each rating and event is credited to at most one impression of the experiment:
the one it names (`recommendation_id`), where that one showed the item (a named impression that did not,
or one of another experiment or route, gets nothing); else, when it names none or one the impressions
stream no longer holds, the user's latest impression that showed the item at most `window_s` before it.
Per variant:

- `impressions`, `users`: answers shown, and users shown at least one;
- `click_through`: impressions with a click on a shown item, of all impressions;
- `hit_rate`: impressions with a shown item clicked or rated at least `hit_rating`;
- `mean_later_rating`: the mean of the ratings given to shown items afterwards;
- `coverage`: distinct items shown to `coverage_users` users (the same number for every variant: the
  expected count over draws of that many of the variant's users), as a share of the artifact's items;
- `rmse`, `log_loss`: online accuracy: the ratings we predicted (and the distributions we served, where
  the answer had one) for the shown items, against the ratings those users then gave them.

Each comes with a 95% interval. Users are what is randomised, so the intervals treat a user's answers as
one unit: each figure is a ratio of per-user sums, its standard error by the delta method over users
(coverage: a delete-a-group jackknife over 20 groups of users, dealt in id order, so the service and `dcmc
experiment report` agree);
differences are against the control, with independent groups' errors combined. An interleaved
experiment also reports per team what its items earned, and `preference`: over users, the share whose
clicks and hits went more to the second variant's items minus the share for the first's, with its
normal interval, and `significant` by the exact sign test over the users with a preference (`p_value`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from scipy.special import gammaln

from model.stream import EVENT, REC, stream_order, text

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""What an experiment id or a variant name looks like."""

Z95 = 1.959963984540054
"""The normal quantile of a two-sided 95% interval."""

JACKKNIFE = 20
"""Groups of users of the coverage's delete-a-group jackknife."""

CLICK = "click"
"""The event kind that counts as a click."""


class ExperimentError(ValueError):
    """An experiments file that cannot be read, said in a few words."""


class VariantSpec(BaseModel):
    """One variant: its name and weight, and what it changes (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME)
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    artifact: str | None = Field(default=None, description="another artifact directory to serve")
    inference: dict[str, Any] = Field(default_factory=dict, description="inference overrides, dotted names")
    ranking: dict[str, Any] = Field(default_factory=dict, description="/recommend's options")

    @property
    def changes_model(self) -> bool:
        """Whether it is served by a model of its own (another artifact, or other inference settings)."""
        return self.artifact is not None or bool(self.inference)


class ExperimentSpec(BaseModel):
    """One experiment (module docstring)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=NAME)
    salt: str = Field(min_length=1, max_length=64)
    description: str = ""
    share: float = Field(default=1.0, gt=0, le=1, description="share of users in the experiment")
    start: datetime | None = None
    end: datetime | None = None
    method: Literal["ab", "interleave"] = "ab"
    variants: list[VariantSpec] = Field(min_length=2, max_length=8, alias="variant")
    hit_rating: float | None = Field(
        default=None,
        allow_inf_nan=False,
        description="a rating at least this is a hit (default: 3/4 up the scale)",
    )
    window_s: float = Field(
        default=86400.0, gt=0, allow_inf_nan=False, description="how long feedback counts"
    )

    @field_validator("start", "end")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentSpec:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names repeat: {names}")
        if self.method == "interleave" and len(self.variants) != 2:
            raise ValueError("an interleaved experiment has exactly two variants")
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise ValueError("end is not after start")
        return self

    @property
    def control(self) -> str:
        """The first variant: differences are measured against it."""
        return self.variants[0].name

    def active(self, now: float | None = None) -> bool:
        """Whether it runs at `now` (seconds since the epoch; default: now)."""
        now = time.time() if now is None else now
        start, end = self._bounds
        return start <= now < end

    def assign(self, user: str) -> str | None:
        """The user's variant, or None when the user is outside the experiment's share (whether it runs
        or not: `active` says)."""
        inside, pick = unit(self.id, self.salt, user, self._key)
        if inside >= self.share:
            return None
        edges = self._edges
        return self.variants[min(bisect.bisect_right(edges, pick), len(edges) - 1)].name

    @property
    def _key(self) -> bytes:
        return salt_key(self.salt)

    @property
    def _edges(self) -> tuple[float, ...]:
        return _edges(tuple(v.weight for v in self.variants))

    @property
    def _bounds(self) -> tuple[float, float]:
        return (
            self.start.timestamp() if self.start is not None else -math.inf,
            self.end.timestamp() if self.end is not None else math.inf,
        )

    def hit_threshold(self, levels: Sequence[float]) -> float:
        """`hit_rating`, or 3/4 of the way up the rating scale (4 on a 1..5 scale)."""
        if self.hit_rating is not None:
            return self.hit_rating
        return float(levels[0]) + 0.75 * (float(levels[-1]) - float(levels[0]))


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    experiments: list[ExperimentSpec] = Field(default_factory=list, alias="experiment")


def read_experiments(path: str | Path) -> list[ExperimentSpec]:
    """The experiments of a TOML file; ExperimentError saying what is wrong (the file, the field)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ExperimentError(f"cannot read the experiments file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ExperimentError(f"the experiments file {path} is not TOML: {exc}") from None
    try:
        experiments = _File.model_validate(raw).experiments
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise ExperimentError(f"the experiments file {path}: {problems}") from None
    ids = [e.id for e in experiments]
    if len(set(ids)) != len(ids):
        raise ExperimentError(f"the experiments file {path}: experiment ids repeat: {ids}")
    return experiments


@lru_cache(maxsize=1024)
def _edges(weights: tuple[float, ...]) -> tuple[float, ...]:
    """Cumulative shares of the weights."""
    total, acc, out = sum(weights), 0.0, []
    for w in weights:
        acc += w
        out.append(acc / total)
    return tuple(out)


@lru_cache(maxsize=1024)
def salt_key(salt: str) -> bytes:
    """The hash key of a salt: its BLAKE2b (so a salt of any length in bytes counts whole)."""
    return hashlib.blake2b(salt.encode(), digest_size=32).digest()


def unit(experiment: str, salt: str, user: str, key: bytes | None = None) -> tuple[float, float]:
    """Two numbers in [0, 1) for the user in the experiment: BLAKE2b of the experiment id and the user,
    keyed by the salt's hash (`key`: `salt_key(salt)`, given where it is kept)."""
    key = salt_key(salt) if key is None else key
    digest = hashlib.blake2b(f"{experiment}\x00{user}".encode(), key=key, digest_size=16).digest()
    scale = float(2**64)
    return int.from_bytes(digest[:8], "big") / scale, int.from_bytes(digest[8:], "big") / scale


def team_draft(first: Sequence[str], second: Sequence[str], k: int, seed: str) -> tuple[list[str], list[int]]:
    """Team-draft interleaving of two ranked lists into at most k items: in each round the team with fewer
    picks (a coin flip, seeded by `seed`, on a tie) adds its best item not yet taken; (items, team of each:
    0 or 1). A team whose list runs out leaves the rest to the other."""
    coin = random.Random(seed)
    lists = (list(first), list(second))
    heads = [0, 0]
    taken: set[str] = set()
    items: list[str] = []
    teams: list[int] = []
    picks = [0, 0]

    def next_of(team: int) -> str | None:
        ranked = lists[team]
        while heads[team] < len(ranked) and ranked[heads[team]] in taken:
            heads[team] += 1
        return ranked[heads[team]] if heads[team] < len(ranked) else None

    while len(items) < k:
        team = 0 if picks[0] < picks[1] else 1 if picks[1] < picks[0] else coin.randrange(2)
        item = next_of(team)
        if item is None:
            team = 1 - team
            item = next_of(team)
            if item is None:
                break
        taken.add(item)
        items.append(item)
        teams.append(team)
        picks[team] += 1
    return items, teams


# -- what the streams hold ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Impression:
    """What one answer showed (service/impressions.py writes them)."""

    id: str
    at: float
    user: str | None
    items: tuple[str, ...]
    scores: tuple[float, ...]
    dists: tuple[tuple[float, ...] | None, ...] | None = None
    experiment: str | None = None
    variant: str | None = None
    teams: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Feedback:
    """A rating or an event from the rating stream: when (the stream id's time), who, what, and the
    recommendation id it names."""

    at: float
    user: str
    item: str
    rating: float | None
    kind: str
    rec: str | None = None


def parse_impression(fields: Mapping[Any, Any]) -> Impression | None:
    """An impressions-stream entry as an Impression, or None for one that does not parse."""
    f = {text(k): text(v) for k, v in fields.items()}
    try:
        items = tuple(str(i) for i in json.loads(f["items"]))
        scores = tuple(float(s) for s in json.loads(f["scores"]))
        dists = json.loads(f["dists"]) if "dists" in f else None
        teams = json.loads(f["teams"]) if "teams" in f else None
        return Impression(
            f["id"],
            float(f["at"]),
            f.get("user"),
            items,
            scores,
            None if dists is None else tuple(None if d is None else tuple(map(float, d)) for d in dists),
            f.get("experiment"),
            f.get("variant"),
            None if teams is None else tuple(map(str, teams)),
        )
    except (KeyError, ValueError, TypeError):
        return None


def parse_feedback(entry_id: str, fields: Mapping[Any, Any]) -> Feedback | None:
    """A rating-stream entry as Feedback (a rating or an event), or None for anything else."""
    f = {text(k): text(v) for k, v in fields.items()}
    if "user" not in f or "item" not in f:
        return None
    at = stream_order(entry_id)[0] / 1000.0
    rec = f.get(REC)
    if EVENT in f:
        return Feedback(at, f["user"], f["item"], None, f[EVENT], rec)
    try:
        rating = float(f["rating"])
    except (KeyError, ValueError):
        return None
    return Feedback(at, f["user"], f["item"], rating, "rating", rec) if math.isfinite(rating) else None


PAGE = 10_000


def read_streams(client: Any, prefix: str) -> tuple[list[Impression], list[Feedback]]:
    """Every impression of `<prefix>:impressions`, and the ratings and events of `<prefix>:ratings` from
    the first impression's time on (what `results` reads)."""
    impressions: list[Impression] = []
    for _, fields in _entries(client, f"{prefix}:impressions", "-"):
        imp = parse_impression(fields)
        if imp is not None:
            impressions.append(imp)
    feedback: list[Feedback] = []
    if impressions:
        since = f"{int(min(i.at for i in impressions) * 1000) - 1000}-0"
        for entry_id, fields in _entries(client, f"{prefix}:ratings", since):
            fb = parse_feedback(entry_id, fields)
            if fb is not None:
                feedback.append(fb)
    return impressions, feedback


def _entries(client: Any, key: str, low: str) -> Iterable[tuple[str, Mapping[Any, Any]]]:
    while True:
        page = client.xrange(key, low, "+", count=PAGE)
        for entry_id, fields in page:
            yield text(entry_id), fields
        if len(page) < PAGE:
            return
        low = "(" + text(page[-1][0])


# -- results ---------------------------------------------------------------------------------------------
@dataclass
class _Users:
    """Per-user sums of one group (a variant, or an interleaved team)."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    shown: dict[str, set[str]] = field(default_factory=dict)

    COLUMNS = ("impressions", "clicked", "hit", "rating_sum", "ratings", "sse", "predicted", "ll", "dists")

    def add(self, user: str, **values: float) -> None:
        row = self.sums.get(user)
        if row is None:
            row = self.sums[user] = np.zeros(len(self.COLUMNS))
        for name, value in values.items():
            row[self.COLUMNS.index(name)] += value

    def column(self, name: str) -> np.ndarray:
        if not self.sums:
            return np.zeros(0)
        return np.array([row[self.COLUMNS.index(name)] for row in self.sums.values()])


def _ratio(y: np.ndarray, x: np.ndarray) -> dict[str, Any]:
    """sum(y) / sum(x) over users, with its delta-method standard error and 95% interval."""
    total = float(x.sum())
    n = len(x)
    if total <= 0:
        return {"value": None, "low": None, "high": None, "se": None, "n": int(total)}
    value = float(y.sum()) / total
    if n > 1:
        residual = y - value * x
        se = math.sqrt(float(residual.var(ddof=1)) / n) / (total / n)
    else:
        se = math.nan
    return _interval(value, se, int(total))


def _interval(value: float, se: float, n: int) -> dict[str, Any]:
    if not math.isfinite(se):
        return {"value": value, "low": None, "high": None, "se": None, "n": n}
    return {"value": value, "low": value - Z95 * se, "high": value + Z95 * se, "se": se, "n": n}


def _rmse(mse: dict[str, Any]) -> dict[str, Any]:
    """RMSE from the MSE's figure: its interval by the delta method (se / (2 sqrt(mse)))."""
    if mse["value"] is None:
        return mse
    value = math.sqrt(mse["value"])
    se = mse["se"] / (2 * value) if mse["se"] is not None and value > 0 else math.nan
    return _interval(value, se, mse["n"])


def difference(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """b - a with the two errors combined (independent groups); `significant`: the interval excludes 0."""
    if a["value"] is None or b["value"] is None or a["se"] is None or b["se"] is None:
        return {"value": None, "low": None, "high": None, "significant": False}
    value = b["value"] - a["value"]
    se = math.sqrt(a["se"] ** 2 + b["se"] ** 2)
    low, high = value - Z95 * se, value + Z95 * se
    return {"value": value, "low": low, "high": high, "significant": bool(low > 0 or high < 0)}


def sign_test(a: int, b: int) -> float:
    """The two-sided p-value of the exact sign test of a wins against b (ties left out)."""
    n = a + b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(a, b) + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def _rarefied(counts: np.ndarray, n: int, m: int) -> float:
    """The expected number of distinct items among m of n users drawn without replacement, when item i
    is shown to counts[i] of them: sum over items of 1 - C(n - k, m) / C(n, m)."""
    k = counts[counts > 0].astype(np.float64)
    if m >= n:
        return float(len(k))
    free = n - k
    missed = np.zeros_like(k)
    ok = free >= m
    missed[ok] = np.exp(
        gammaln(free[ok] + 1) - gammaln(free[ok] - m + 1) - gammaln(n + 1) + gammaln(n - m + 1)
    )
    return float((1.0 - missed).sum())


def _coverage(group: _Users, m: int) -> tuple[float, float]:
    """Distinct items shown to m of the group's users (expected over draws: rarefied, so that groups of
    unequal size compare), and its standard error by the delete-a-group jackknife over users (JACKKNIFE
    groups: the users in id order, dealt round; nan for fewer than 2 users)."""
    users = sorted(group.shown)
    n = len(users)
    if n == 0:
        return 0.0, math.nan
    groups = min(JACKKNIFE, n)
    per_item: dict[str, np.ndarray] = {}  # item -> users showing it, per group
    for position, user in enumerate(users):
        for item in sorted(group.shown[user]):  # one order in every process (sums of floats)
            held = per_item.get(item)
            if held is None:
                held = per_item[item] = np.zeros(groups, dtype=np.int64)
            held[position % groups] += 1
    table = np.array(list(per_item.values())).reshape(-1, groups)
    total = table.sum(axis=1)
    value = _rarefied(total, n, m)
    if n < 2:
        return value, math.nan
    sizes = np.bincount(np.arange(n) % groups, minlength=groups)
    left = np.array([_rarefied(total - table[:, g], n - int(sizes[g]), m) for g in range(groups)])
    return value, math.sqrt((groups - 1) / groups * float(((left - left.mean()) ** 2).sum()))


def _figures(group: _Users, n_items: int, m: int) -> dict[str, Any]:
    shown, se = _coverage(group, m)
    cover = _interval(shown / n_items, se / n_items, m)
    impressions = group.column("impressions")
    return {
        "users": len(group.sums),
        "impressions": int(impressions.sum()),
        "click_through": _ratio(group.column("clicked"), impressions),
        "hit_rate": _ratio(group.column("hit"), impressions),
        "mean_later_rating": _ratio(group.column("rating_sum"), group.column("ratings")),
        "coverage": cover,
        "rmse": _rmse(_ratio(group.column("sse"), group.column("predicted"))),
        "log_loss": _ratio(group.column("ll"), group.column("dists")),
    }


METRICS = ("click_through", "hit_rate", "mean_later_rating", "coverage", "rmse", "log_loss")
"""The figures of a variant that have intervals (and differences)."""


def _credited(
    spec: ExperimentSpec,
    impressions: Sequence[Impression],
    feedback: Sequence[Feedback],
    held: set[str] | frozenset[str] = frozenset(),
) -> dict[str, list[tuple[int, Feedback]]]:
    """Impression id -> the (position of the item in it, feedback) credited to it, among `impressions`
    (the experiment's); `held`: the ids of every impression read (of any experiment or route): feedback
    naming one of them goes to that one only."""
    by_id = {imp.id: imp for imp in impressions}
    by_user: dict[str, list[Impression]] = {}
    for imp in sorted(impressions, key=lambda i: i.at):
        if imp.user is not None:
            by_user.setdefault(imp.user, []).append(imp)
    out: dict[str, list[tuple[int, Feedback]]] = {}
    for fb in feedback:
        named = by_id.get(fb.rec) if fb.rec is not None else None
        target: Impression | None = None
        if named is not None and named.user == fb.user and fb.item in named.items:
            target = named
        elif fb.rec is None or (named is None and fb.rec not in held):  # names none, or one trimmed
            for imp in reversed(by_user.get(fb.user, ())):
                if imp.at > fb.at + 1.0:  # a second's slack between a worker's clock and Redis's
                    continue
                if fb.at - imp.at > spec.window_s:
                    break
                if fb.item in imp.items:
                    target = imp
                    break
        if target is not None:
            out.setdefault(target.id, []).append((target.items.index(fb.item), fb))
    return out


def _outcome(
    imp: Impression, credited: Sequence[tuple[int, Feedback]], levels: np.ndarray, threshold: float
) -> tuple[dict[str, float], set[int]]:
    """One impression's sums (for `_Users.add`), and the positions of its items that were hits."""
    clicked = hit = False
    hits: set[int] = set()
    values = {"rating_sum": 0.0, "ratings": 0.0, "sse": 0.0, "predicted": 0.0, "ll": 0.0, "dists": 0.0}
    rated: set[int] = set()
    for position, fb in credited:
        if fb.kind == CLICK:
            clicked = hit = True
            hits.add(position)
        if fb.rating is None or position in rated:
            continue
        rated.add(position)  # a pair's first rating after the answer
        if fb.rating >= threshold - 1e-9:
            hit = True
            hits.add(position)
        values["rating_sum"] += fb.rating
        values["ratings"] += 1
        values["sse"] += (imp.scores[position] - fb.rating) ** 2
        values["predicted"] += 1
        dist = imp.dists[position] if imp.dists is not None else None
        if dist is not None and len(dist) == len(levels):
            level = int(np.argmin(np.abs(levels - fb.rating)))
            values["ll"] += -math.log(max(dist[level], 1e-12))
            values["dists"] += 1
    return {"impressions": 1.0, "clicked": float(clicked), "hit": float(hit), **values}, hits


def results(
    spec: ExperimentSpec,
    impressions: Sequence[Impression],
    feedback: Sequence[Feedback],
    levels: Sequence[float],
    n_items: int,
) -> dict[str, Any]:
    """The experiment's figures (module docstring) from the impressions and the feedback read."""
    mine = [imp for imp in impressions if imp.experiment == spec.id and imp.user is not None]
    mine.sort(key=lambda i: (i.at, i.id))
    credited = _credited(spec, mine, feedback, {imp.id for imp in impressions})
    levels_a = np.asarray(levels, dtype=np.float64)
    threshold = spec.hit_threshold(levels)
    names = [v.name for v in spec.variants]
    groups = {name: _Users() for name in names}
    preference: dict[str, float] = {}  # interleaved: user -> credits of the second team minus the first's
    for imp in mine:
        assert imp.user is not None
        sums, hits = _outcome(imp, credited.get(imp.id, ()), levels_a, threshold)
        if spec.method == "ab":
            if imp.variant in groups:
                groups[imp.variant].add(imp.user, **sums)
                groups[imp.variant].shown.setdefault(imp.user, set()).update(imp.items)
            continue
        if imp.teams is None or len(imp.teams) != len(imp.items):
            continue
        clicks = {p for p, fb in credited.get(imp.id, ()) if fb.kind == CLICK}
        score = 0.0
        for name in names:
            positions = [p for p, team in enumerate(imp.teams) if team == name]
            team_hits = sum(1 for p in positions if p in hits)
            groups[name].add(
                imp.user,
                impressions=1.0,
                clicked=float(any(p in clicks for p in positions)),
                hit=float(team_hits > 0),
            )
            groups[name].shown.setdefault(imp.user, set()).update(imp.items[p] for p in positions)
            score += team_hits if name == names[1] else -team_hits
        preference[imp.user] = preference.get(imp.user, 0.0) + score
    # Coverage at as many users as every variant holds, less a jackknife group's share (so that each
    # deletion still holds them): a larger group shows more distinct items whatever it is shown.
    smallest = min((len(g.shown) for g in groups.values() if g.shown), default=1)  # of those shown any
    at = max(1, smallest - -(-smallest // JACKKNIFE)) if smallest > 1 else max(smallest, 1)
    figures = {name: _figures(groups[name], n_items, at) for name in names}
    control = figures[spec.control]
    out: dict[str, Any] = {
        "experiment": spec.id,
        "method": spec.method,
        "control": spec.control,
        "hit_rating": threshold,
        "window_s": spec.window_s,
        "coverage_users": at,
        "impressions_read": len(impressions),
        "feedback_read": len(feedback),
        "variants": figures,
        "differences": {},
    }
    for name in names[1:]:
        diffs = {m: difference(control[m], figures[name][m]) for m in METRICS}
        out["differences"][name] = diffs
    if spec.method == "interleave":
        signs = np.sign(np.array(list(preference.values()))) if preference else np.zeros(0)
        n = len(signs)
        wins = {names[0]: int((signs < 0).sum()), names[1]: int((signs > 0).sum())}
        value = float(signs.mean()) if n else None
        se = float(signs.std(ddof=1)) / math.sqrt(n) if n > 1 else math.nan
        pref: dict[str, Any] = (
            _interval(value, se, n) if value is not None else {"value": None, "low": None, "high": None}
        )
        # Significance by the exact two-sided sign test over the users with a preference (the normal
        # interval is too narrow when few users have one).
        pref["p_value"] = sign_test(wins[names[0]], wins[names[1]])
        pref["significant"] = bool(pref["p_value"] < 0.05)
        out["interleaving"] = {"users": n, "wins": wins, "ties": n - sum(wins.values()), "preference": pref}
    return out


def _shown(figure: dict[str, Any], percent: bool) -> str:
    if figure.get("value") is None:
        return "-"
    scale, unit = (100.0, "%") if percent else (1.0, "")
    text_ = f"{figure['value'] * scale:.3g}{unit}"
    if figure.get("low") is not None:
        text_ += f" [{figure['low'] * scale:.3g}, {figure['high'] * scale:.3g}]"
    return text_


def report_table(figures: dict[str, Any]) -> str:
    """`results` as a few lines of text: a row per variant, then the differences from the control."""
    percent = {"click_through", "hit_rate", "coverage"}
    head = f"experiment {figures['experiment']} ({figures['method']}; control {figures['control']})"
    lines = [head, f"{'variant':<16}{'users':>7}{'impr.':>8}  " + "  ".join(f"{m:<24}" for m in METRICS)]
    for name, v in figures["variants"].items():
        cells = "  ".join(f"{_shown(v[m], m in percent):<24}" for m in METRICS)
        lines.append(f"{name:<16}{v['users']:>7}{v['impressions']:>8}  {cells}")
    for name, diffs in figures["differences"].items():
        cells = "  ".join(
            f"{_shown(diffs[m], m in percent) + (' *' if diffs[m]['significant'] else ''):<24}"
            for m in METRICS
        )
        lines.append(f"{name + ' - ' + figures['control']:<31}  {cells}")
    if "interleaving" in figures:
        i = figures["interleaving"]
        lines.append(
            f"interleaving: {i['users']} users, wins {i['wins']}, ties {i['ties']}, preference "
            f"{_shown(i['preference'], False)}{' *' if i['preference']['significant'] else ''}"
        )
    lines.append("[95% intervals; * the interval excludes 0]")
    return "\n".join(lines)
