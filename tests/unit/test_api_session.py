"""How many connections kopf's session may hold (the bound itself is measured against the real
API server in tests/integration/test_api_connections.py)."""

from __future__ import annotations

import pytest

from preshard.controller.handlers import API_REQUESTS, WATCHED, api_connection_limit


@pytest.mark.parametrize(
    ("namespaces", "streams"),
    [((), 4), (("models",), 4), (("a", "b", "c"), 12)],
)
def test_every_watch_stream_has_its_connection_and_requests_have_more(
    namespaces: tuple[str, ...], streams: int
) -> None:
    assert len(WATCHED) == 4
    assert api_connection_limit(namespaces) == streams + API_REQUESTS


@pytest.mark.parametrize("pattern", ["team-*", "ns-?", "[ab]-models", "!kube-system"])
def test_a_namespace_pattern_leaves_the_pool_unbounded(pattern: str) -> None:
    # kopf watches every namespace the pattern matches, as they come: a bound could starve it.
    assert api_connection_limit(("models", pattern)) == 0
