"""The Kubernetes quantity grammar, checked against Kubernetes' own examples.

`KUBERNETES_PARSE` is the table of `TestQuantityParse` in k8s.io/apimachinery
(`pkg/api/resource/quantity_test.go`): each input with the value `ParseQuantity` gives it, also
with a leading `-` and `+`; `KUBERNETES_INVALID` is that test's list of strings it refuses.
`DOCS` are the examples of the Kubernetes documentation ("Resource Management for Pods and
Containers": the same memory written five ways, and CPU).
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from preshard.contract.quantity import (
    MAX_BINARY,
    QUANTITY_PATTERN,
    QuantityError,
    parse_quantity,
    whole_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
F = Fraction
NANO = 10**9

KUBERNETES_PARSE: list[tuple[str, Fraction | int]] = [
    ("0", 0),
    ("0n", 0),
    ("0u", 0),
    ("0m", 0),
    ("0Ki", 0),
    ("0k", 0),
    ("0Mi", 0),
    ("0M", 0),
    ("0Gi", 0),
    ("0G", 0),
    ("0Ti", 0),
    ("0T", 0),
    # Quantity-less numbers are allowed.
    ("1", 1),
    # Binary suffixes.
    ("1Ki", 1024),
    ("8Ki", 8 * 1024),
    ("7Mi", 7 * 2**20),
    ("6Gi", 6 * 2**30),
    ("5Ti", 5 * 2**40),
    ("4Pi", 4 * 2**50),
    ("3Ei", 3 * 2**60),
    ("10Ti", 10 * 2**40),
    ("100Ti", 100 * 2**40),
    # Decimal suffixes.
    ("5n", F(5, NANO)),
    ("4u", F(4, 10**6)),
    ("3m", F(3, 1000)),
    ("9", 9),
    ("8k", 8000),
    ("50k", 50_000),
    ("7M", 7 * 10**6),
    ("6G", 6 * 10**9),
    ("5T", 5 * 10**12),
    ("40T", 4 * 10**13),
    ("300T", 3 * 10**14),
    ("2P", 2 * 10**15),
    ("1E", 10**18),
    # Decimal exponents.
    ("1E-3", F(1, 1000)),
    ("1e3", 1000),
    ("1E6", 10**6),
    ("1e9", 10**9),
    ("1E12", 10**12),
    ("1e15", 10**15),
    ("1E18", 10**18),
    # Nonstandard but still parsable.
    ("1e14", 10**14),
    ("1e13", 10**13),
    ("100.035k", 100_035),
    # Things that look like floating point.
    ("0.001", F(1, 1000)),
    ("0.0005k", F(1, 2)),
    ("0.005", F(5, 1000)),
    ("0.05", F(5, 100)),
    ("0.5", F(1, 2)),
    ("0.00050k", F(1, 2)),
    ("0.00500", F(5, 1000)),
    ("0.05000", F(5, 100)),
    ("0.50000", F(1, 2)),
    ("0.5e0", F(1, 2)),
    ("0.5e-1", F(5, 100)),
    ("0.5e-2", F(5, 1000)),
    ("10.035M", 10_035_000),
    ("1.2e3", 1200),
    ("1.3E+6", 1_300_000),
    ("1.40e9", 14 * 10**8),
    ("1.53E12", 153 * 10**10),
    ("1.6e15", 16 * 10**14),
    ("1.7E18", 17 * 10**17),
    ("9.01", F(901, 100)),
    ("8.1k", 8100),
    ("7.123456M", 7_123_456),
    ("6.987654321G", 6_987_654_321),
    ("5.444T", 5444 * 10**9),
    ("40.1T", 401 * 10**11),
    ("300.2T", 3002 * 10**11),
    ("2.5P", 25 * 10**14),
    ("1.01E", 101 * 10**16),
    # Things that saturate or round.
    ("3.001n", F(4, NANO)),
    ("1.1E-9", F(2, NANO)),
    ("0.0000000001", F(1, NANO)),
    ("0.0000000005", F(1, NANO)),
    ("0.00000000050", F(1, NANO)),
    ("0.5e-9", F(1, NANO)),
    ("0.9n", F(1, NANO)),
    ("0.00000012345", F(124, NANO)),
    ("0.00000012354", F(124, NANO)),
    ("9Ei", MAX_BINARY),
    ("9223372036854775807Ki", MAX_BINARY),
    ("12E", 12 * 10**18),
    # Fractional binary quantities.
    ("100.035Ki", F(10_243_584, 100)),
    ("0.5Mi", 2**19),
    ("0.05Gi", F(536_870_912, 10)),
    ("0.025Ti", F(274_877_906_944, 10)),
    # Things written by trolls.
    ("0.000000000001Ki", F(2, NANO)),
    (".001", F(1, 1000)),
    (".0001k", F(1, 10)),
    ("1.", 1),
    ("1.G", 10**9),
]

KUBERNETES_INVALID = [
    "1.1.M",
    "1+1.0M",
    "0.1mi",
    "0.1am",
    "aoeu",
    ".5i",
    "1i",
    "-3.01i",
    "-3.01e-",
    " 1",
    "1 ",
    "",
]

# The Kubernetes documentation: "128974848, 129e6, 129M, 128974848000m, 123Mi" are about the
# same memory; CPU "0.1" is "100m".
DOCS: list[tuple[str, Fraction | int]] = [
    ("128974848", 128_974_848),
    ("129e6", 129_000_000),
    ("129M", 129_000_000),
    ("128974848000m", 128_974_848),
    ("123Mi", 128_974_848),
    ("0.1", F(1, 10)),
    ("100m", F(1, 10)),
    ("1.5", F(3, 2)),
    ("1.5Gi", 1536 * 2**20),
]


@pytest.mark.parametrize(("text", "value"), KUBERNETES_PARSE + DOCS)
def test_kubernetes_examples(text: str, value: Fraction | int) -> None:
    assert parse_quantity(text) == value
    assert parse_quantity("+" + text) == value
    assert parse_quantity("-" + text) == -value


@pytest.mark.parametrize(
    "text",
    [
        *KUBERNETES_INVALID,
        # Kubernetes' parser reads these as 0; its documented grammar and the CRD's pattern
        # refuse them.
        ".",
        "+",
        "-",
        "-.",
        # The exponent is an integer (ParseQuantity parses it with strconv.ParseInt).
        "1e1.5",
        "1e.5",
        "1e",
        "1E+",
        "1K",
        "Mi",
        "1Mi ",
        "1 Mi",
        "１",  # noqa: RUF001 - a full-width digit is not a digit here
    ],
)
def test_invalid_quantities(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


@pytest.mark.parametrize("text", ["1e1001", "1e-1001", "1" * 1001])
def test_numbers_no_quantity_comes_near_are_refused(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)
    assert parse_quantity("1e1000") == 10**1000


def test_the_crd_and_the_chart_use_the_same_pattern() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "shardedmodels.preshard.dev.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    serialization = spec["properties"]["serialization"]["properties"]
    for field in ("scratchSize", "memory", "cpu"):
        assert serialization[field]["pattern"] == QUANTITY_PATTERN
    # The chart's values schema checks config.scratchSize with it too.
    values = json.loads((ROOT / "charts" / "preshard" / "values.schema.json").read_text())
    assert values["definitions"]["quantityString"]["pattern"] == QUANTITY_PATTERN
    pattern = re.compile(QUANTITY_PATTERN)
    for text, _ in KUBERNETES_PARSE + DOCS:
        assert pattern.match(text), text
        assert pattern.match("-" + text), text
    for text in KUBERNETES_INVALID:
        assert not pattern.match(text), text
    # The published pattern lets an exponent have a fraction, which the parser refuses.
    assert pattern.match("1e1.5")


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("200Gi", 200 * 2**30),
        ("1e11", 10**11),
        ("+100Gi", 100 * 2**30),
        (".5Ti", 2**39),
        ("1.5Ki", 1536),
        ("1.5", 1),
        ("1999m", 1),
        ("67108864", 67_108_864),
        ("8Ei", MAX_BINARY),
    ],
)
def test_whole_bytes(text: str, count: int) -> None:
    assert whole_bytes(text) == count


@pytest.mark.parametrize("text", ["0", "0Gi", "-5Gi", "1m", "999m", "12 MB", "Mi"])
def test_sizes_under_a_byte_or_not_quantities_are_refused(text: str) -> None:
    with pytest.raises(QuantityError):
        whole_bytes(text)
