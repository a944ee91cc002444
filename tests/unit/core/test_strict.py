"""The rule for integers from outside: integral numbers within 64 bits, nothing else."""

from __future__ import annotations

import pytest

from replay.core.strict import integer, token_ids


@pytest.mark.parametrize(
    ("value", "taken"),
    [
        (16, 16),
        (16.0, 16),
        (2**63 - 1, 2**63 - 1),
        (-(2**63), -(2**63)),
        (2**63, None),  # past 64 bits: no count or id is, and orjson could not write it
        (1.8446744073709552e19, None),
        (16.5, None),
        (float("nan"), None),
        (True, None),
        ("16", None),
    ],
)
def test_an_integer_is_integral_and_within_64_bits(value: object, taken: int | None) -> None:
    assert integer(value) == taken


def test_token_ids_past_64_bits_are_not_token_ids() -> None:
    assert token_ids([1, 2.0]) == [1, 2]
    assert token_ids([1, 2**64]) is None
