"""Request and response bodies of the HTTP API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StringConstraints,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from model.stream import MAX_ID_LENGTH, REC_ID

__all__ = ["MAX_ID_LENGTH"]  # the longest external id a request may carry (model/stream.py)

ID_TYPE_MESSAGE = "Input should be a valid string or integer id (not a boolean, float or null)"
"""The 422 message (type `id_type`) of an id that is neither a string nor an integer."""


class _ExternalIdSchema:
    """Validation of one external id: a JSON string, or a JSON integer read as its decimal string.

    Integers come in as the same id: `196` means `"196"`. Booleans (an int in Python), floats (`1.0`
    included: `"1"` and `"1.0"` would be different ids), null and anything else are rejected, and so is an
    id outside 1..MAX_ID_LENGTH characters. All of it runs in pydantic-core; only integers call `str`.
    """

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        either = core_schema.union_schema(
            [
                core_schema.str_schema(strict=True),
                core_schema.no_info_after_validator_function(str, core_schema.int_schema(strict=True)),
            ],
            custom_error_type="id_type",
            custom_error_message=ID_TYPE_MESSAGE,
        )
        return core_schema.chain_schema(
            [either, core_schema.str_schema(min_length=1, max_length=MAX_ID_LENGTH)]
        )

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH},
                {"type": "integer"},
            ]
        }


ExternalId = Annotated[str, _ExternalIdSchema()]
"""An external user or item id in a request body: a string, or an integer taken as its decimal string."""

RecommendationId = Annotated[str, StringConstraints(strict=True, pattern=REC_ID.pattern)]
"""A `recommendation_id` as answers carry it: 32 lowercase hex digits."""


class PredictRequest(BaseModel):
    """Rating queries for one user."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"user": "196", "items": ["242", "302"]}, {"user": 196, "items": [242, "302"]}]
        },
    )

    user: ExternalId = Field(
        description='External user id, as in the dataset (MovieLens: "196"); an integer means its decimal '
        "string."
    )
    items: list[ExternalId] = Field(
        min_length=1, description="External item ids (strings or integers); answered in this order."
    )
    distribution: bool = Field(default=False, description="Also return each rating's label distribution.")
    explain: bool = Field(
        default=False,
        description="Also return which known ratings moved each prediction, by exactly how much "
        "(`exact` inference only; 422 otherwise). docs/explanations.md.",
    )
    track: bool = Field(
        default=False,
        description="Also answer with a `recommendation_id`, keep what was predicted in the impressions "
        "stream (online accuracy: docs/experiments.md), and answer as the user's variant where the user is "
        "in an A/B experiment whose variant has a model of its own.",
    )


class Because(BaseModel):
    """One known rating and what it did to a prediction."""

    user: str
    item: str
    rating: float = Field(description="The known rating (training, held-out or online).")
    effect: float = Field(
        description="The prediction minus the prediction without this rating's CRF terms (the network's "
        "outputs and every other term held): positive when the rating raised it."
    )


class Others(BaseModel):
    """Other users' known ratings of one item at one level among those that moved a prediction most, shown
    without who gave them (the caller does not hold the write token)."""

    item: str
    rating: float
    users: int = Field(description="How many other users' ratings of this item at this level are among them.")
    effect: float = Field(description="Their effects summed.")


class Explanation(BaseModel):
    """Why a prediction is what it is."""

    network: float | None = Field(
        default=None, description="The base network's expected rating of the entry, before any CRF term."
    )
    because: list[Because] | None = Field(
        default=None,
        description="Of the DCMC_EXPLAIN_K known ratings whose terms moved the entry most (never the entry "
        "itself), largest |effect| first: the asking user's own, and other users' too where the caller "
        "holds the write token.",
    )
    others: list[Others] | None = Field(
        default=None,
        description="The rest of those ratings, other users', grouped by item and rating without their ids "
        "(only without the write token).",
    )
    reason: str | None = Field(
        default=None, description="Set instead of `because` when no known rating's term shaped the answer."
    )


class Prediction(BaseModel):
    """The predicted rating of one item."""

    item: str
    rating: float = Field(description="Expected rating sum_u L_u P_u, within the rating scale.")
    distribution: list[float] | None = Field(
        default=None,
        description="P(rating = L_u) per level, tempered by the artifact's calibration where it has one "
        "(`rating` stays the expected rating of the untempered distribution).",
    )
    fallback: Literal["baseline"] | None = Field(
        default=None,
        description="`baseline`: a new item the network cannot embed yet (none of its raters is a user the "
        "model was trained on), predicted by the bias baseline mu + b_user + c_item.",
    )
    explanation: Explanation | None = Field(default=None, description='With `"explain": true`.')


class PredictResponse(BaseModel):
    """Predicted ratings in request order."""

    user: str
    model_version: str
    inference: Literal["paper", "none", "exact"]
    online_ratings: int = Field(
        description="The user's ratings that arrived online (POST /ratings, from Redis) and are folded into "
        "these answers; 0 = the artifact's model of the user."
    )
    predictions: list[Prediction]
    recommendation_id: str | None = Field(
        default=None, description="With `track`: this answer's id, to send back with the ratings that follow"
    )
    experiment: str | None = Field(default=None, description="With `track`: the user's A/B experiment")
    variant: str | None = Field(default=None, description="With `track`: the user's variant in it")


class SimilarUser(BaseModel):
    """One neighbour and its learned similarity."""

    user: str
    score: float = Field(description="Scaled cosine s_r = (1 + cos) / 2 of the user embeddings, in [0, 1].")


class SimilarUsersResponse(BaseModel):
    """The most similar other users, most similar first."""

    user: str
    model_version: str
    similar: list[SimilarUser]


class SimilarItem(BaseModel):
    """One neighbouring item and its learned similarity."""

    item: str
    score: float = Field(description="Scaled cosine s_c = (1 + cos) / 2 of the item embeddings, in [0, 1].")


class SimilarItemsResponse(BaseModel):
    """The most similar other items, most similar first."""

    item: str
    model_version: str
    filter_notes: list[str] | None = Field(
        default=None,
        description="Clauses of the filter that match nothing because no item has what they name",
    )
    similar: list[SimilarItem]
    recommendation_id: str = Field(
        description="This answer's id (32 hex digits): what it showed is kept in the impressions stream."
    )


class Replication(BaseModel):
    """This worker's stream follower (service/replication.py)."""

    phase: Literal["starting", "catching_up", "following", "degraded"]
    ready: bool
    reason: str | None = Field(description="Why it is not following (the failure while degraded).")
    applied_up_to: str = Field(description="The last stream entry its state includes.")
    gaps: int = Field(description="Compactions that trimmed the stream past it (it folded the head in).")
    lost_gaps: int = Field(description="Deletions past it that no compacted head held (entries lost).")
    last_gap: str | None
    rebuild: str | None = Field(description="Why its state is being rebuilt from the artifact, if it is.")


class Health(BaseModel):
    """Liveness, and the state of the online ratings' Redis."""

    status: Literal["ok", "degraded", "starting"]
    model_version: str | None
    redis: Literal["ok", "down", "disabled", "unknown"]
    durable: bool | None = Field(
        default=None,
        description="Whether Redis keeps acknowledged ratings through a crash and a failover (append-only "
        "file fsynced always, no eviction of the stream, writes that wait for the replicas it has); false "
        "means acknowledged ratings can be lost (with DCMC_REQUIRE_DURABLE, writes are then refused).",
    )
    durability: str | None = Field(default=None, description="Why `durable` says what it says.")
    writes: str | None = Field(default=None, description="`enabled`, or why POST /ratings is off.")
    ready: bool | None = Field(default=None, description="What /ready answers (true: 200).")
    replication: Replication | None = Field(
        default=None, description="Where this worker's stream follower stands (null without Redis)."
    )
    online_ratings: int | None = Field(default=None, description="Online ratings this worker has applied.")
    catalogue_changes: int | None = Field(
        default=None,
        description="Online catalogue changes (PUT / PATCH / POST /items) this worker has applied.",
    )
    skipped_entries: int | None = Field(
        default=None,
        description="Rating stream entries this worker could not apply (a missing field, a bad value): "
        "skipped and copied to the dead-letter stream `<prefix>:ratings:dead-letter`.",
    )
    last_skipped_entry: dict[str, str] | None = Field(
        default=None, description="The last of them: its stream `id` and the `reason`."
    )
    loading_model_version: str | None = Field(
        default=None, description="A new artifact's model version while this worker loads it (hot reload)."
    )
    reload_error: str | None = Field(
        default=None, description="Why the last new artifact was refused (the old model kept serving)."
    )


class Ready(BaseModel):
    """Readiness: true once the artifact is loaded."""

    ready: bool
    model_version: str | None
