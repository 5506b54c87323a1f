from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class ContributorCreate(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[\x21-\x7e][\x20-\x7e]*$")


class ContributorCreated(BaseModel):
    id: str
    name: str
    token: str  # shown once: only its hash is stored


class ContributorOut(BaseModel):
    id: str
    name: str
    created_at: datetime


class LeaderboardEntry(BaseModel):
    id: str
    name: str
    accepted: int
    tokens: int


class Leaderboard(BaseModel):
    contributors: list[LeaderboardEntry]
