"""SLOs: ``--slo``'s grammar (one scope, bucket scopes, what a bad one names) and when a request
meets them. Attainment and goodput in the summary are tests/unit/analysis/test_goodput.py."""

from __future__ import annotations

import pytest

from replay.core.errors import InputError
from replay.core.slo import Slo, meets, parse_slo


def test_one_scope_gives_the_default_bounds() -> None:
    spec = parse_slo("ttft=2s,itl=80ms,e2e=30s")
    assert spec.default == Slo(ttft=2.0, itl=0.08, e2e=30.0)
    assert spec.for_bucket("<8K") == spec.default and spec.text == "ttft=2s,itl=80ms,e2e=30s"


def test_a_bucket_scope_overrides_only_what_it_names() -> None:
    spec = parse_slo("ttft=2s,e2e=30s;>=32K:ttft=8s", ["<32K", ">=32K"])
    assert spec.for_bucket(">=32K") == Slo(ttft=8.0, e2e=30.0)
    assert spec.for_bucket("<32K") == Slo(ttft=2.0, e2e=30.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--slo: empty"),
        ("ttft", "'ttft' is not metric=duration"),
        ("latency=2s", "unknown metric 'latency'"),
        ("ttft=2", "'2' is not a duration"),
        ("ttft=0ms", "must be above zero"),
        ("ttft=1s,ttft=2s", "'ttft' is given twice"),
        ("ttft=1s;<1K:ttft=2s", "bucket '<1K' is not one of this run's buckets"),
        ("ttft=1s;e2e=3s", "needs a bucket label"),
    ],
)
def test_a_bad_slo_names_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        parse_slo(text, ["<8K", ">=8K"])


def test_a_request_meets_its_slos_only_when_it_succeeded_within_every_bound() -> None:
    slo = Slo(ttft=1.0, itl=0.1, e2e=5.0)
    assert meets(slo, True, 0.5, 0.05, 4.0)
    assert not meets(slo, False, 0.5, 0.05, 4.0)  # an error never meets them
    assert not meets(slo, True, 1.5, 0.05, 4.0)
    assert not meets(slo, True, 0.5, 0.2, 4.0)
    assert meets(slo, True, 0.5, None, 4.0)  # a one-token answer has no TPOT
    assert not meets(slo, True, None, 0.05, 4.0)  # no first token: TTFT is not met
