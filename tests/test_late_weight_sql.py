"""The late-merge weight has one definition, ``diloco.protocol.late.late_weight``; the sums
the rounds list makes in SQL use its SQL form, and Postgres gives the very same answers."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import BigInteger, Integer, literal, select
from sqlalchemy.ext.asyncio import create_async_engine

from diloco.protocol.late import late_weight
from server.rounds.models import Contribution, late_weight_sql

CASES = [(w, s) for w in (0, 1, 2, 3, 4, 5, 7, 100, 4097, (1 << 53) + 1) for s in range(0, 11)]


async def _in_postgres(url: str, cases: list[tuple[int, int]]) -> list[int]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            columns = [
                late_weight_sql(literal(w, BigInteger), literal(s, Integer)) for w, s in cases
            ]
            return list((await conn.execute(select(*columns))).one())
    finally:
        await engine.dispose()


def test_postgres_computes_the_late_weight_as_the_protocol_rule_does(pg_admin_url):
    got = asyncio.run(_in_postgres(pg_admin_url, CASES))

    assert got == [late_weight(w, s) for w, s in CASES]
    assert got[CASES.index((4, 1))] == 2  # ⌈4 / 2⌉: integer division, never 2.5


@pytest.mark.parametrize(
    ("tokens", "weight", "staleness", "counted"),
    [(100, None, 0, 100), (100, None, 1, 50), (100, 64, 2, 22), (9, 9, 3, 3)],
)
def test_a_rows_counted_weight_is_its_measured_weight_discounted(
    tokens, weight, staleness, counted
):
    row = Contribution(tokens=tokens, weight=weight, staleness=staleness)

    assert row.counted_weight == counted == late_weight(weight or tokens, staleness)
