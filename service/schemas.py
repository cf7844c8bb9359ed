"""Request and response bodies of the HTTP API."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PredictRequest(BaseModel):
    """Rating queries for one user."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"user": "196", "items": ["242", "302"]}]}
    )

    user: str = Field(min_length=1, description='External user id, as in the dataset (MovieLens: "196").')
    items: list[str] = Field(min_length=1, description="External item ids; answered in this order.")
    distribution: bool = Field(default=False, description="Also return each rating's label distribution.")


class Prediction(BaseModel):
    """The predicted rating of one item."""

    item: str
    rating: float = Field(description="Expected rating sum_u L_u P_u, within the rating scale.")
    distribution: list[float] | None = Field(default=None, description="P(rating = L_u) per level.")


class PredictResponse(BaseModel):
    """Predicted ratings in request order."""

    user: str
    model_version: str
    inference: Literal["paper", "none", "exact"]
    predictions: list[Prediction]


class SimilarUser(BaseModel):
    """One neighbour and its learned similarity."""

    user: str
    score: float = Field(description="Scaled cosine s_r = (1 + cos) / 2 of the user embeddings, in [0, 1].")


class SimilarUsersResponse(BaseModel):
    """The most similar other users, most similar first."""

    user: str
    model_version: str
    similar: list[SimilarUser]


class Health(BaseModel):
    """Liveness and the state of the shared cache tier."""

    status: Literal["ok", "degraded", "starting"]
    model_version: str | None
    redis: Literal["ok", "down", "disabled", "unknown"]


class Ready(BaseModel):
    """Readiness: true once the artifact is loaded."""

    ready: bool
    model_version: str | None
