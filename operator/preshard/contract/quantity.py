"""Kubernetes resource quantities (`200Gi`, `1e11`, `+100Gi`, `.5Ti`), read one way everywhere.

The spec's sizes are Kubernetes quantities: the API server checks them against the CRD's
pattern, the controller copies them into Jobs (an `emptyDir` size limit, resource requests),
and `preshard serialize` compares the scratch space it needs with the same value. All of them
read a quantity with `parse_quantity`, which follows the grammar of Kubernetes' own parser
(`k8s.io/apimachinery/pkg/api/resource`, `ParseQuantity`):

    <quantity>        ::= <signedNumber><suffix>
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <signedNumber>    ::= <number> | "+" <number> | "-" <number>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedInteger> | "E" <signedInteger>

The value is the one the API server keeps: exact (never a float), a non-zero value finer than
a nano-unit rounded up, away from zero, to one, and a binary-suffixed value capped at 2^63 - 1.
Two departures, both refusals of what no size comes near: Kubernetes reads the lone strings
`.`, `+` and `-` as zero, which its own documented grammar and the CRD's pattern refuse, and so
does this parser; and a decimal exponent beyond +-1000 or more than 1000 digits are refused
(Kubernetes allows any 32-bit exponent), so that a short string cannot make a huge number.

Everything here is pure.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Final

# The pattern Kubernetes publishes for quantities in OpenAPI schemas (the CRD's, too). It lets
# a decimal exponent have a fraction (`1e1.5`), which `ParseQuantity` refuses; `parse_quantity`
# refuses it as well.
QUANTITY_PATTERN: Final = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
MAX_EXPONENT: Final = 1000
# What a binary-suffixed quantity is capped at (`8Ei` parses as this).
MAX_BINARY: Final = 2**63 - 1

_GRAMMAR: Final = re.compile(
    r"(?P<sign>[+-])?(?P<whole>[0-9]*)(?:\.(?P<fraction>[0-9]*))?"
    r"(?:(?P<binary>[KMGTPE]i)|(?P<exponent>[eE][+-]?[0-9]+)|(?P<decimal>[numkMGTPE]))?"
)
_BINARY: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL: Final = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_NANO: Final = 10**9
# Python refuses to convert longer digit strings; no quantity needs a thousandth of that.
_MAX_DIGITS: Final = 1000


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity, or not one of the size asked for."""


def parse_quantity(text: str) -> Fraction:
    """The exact value of a Kubernetes quantity, as the API server keeps it.

    Raises QuantityError for anything Kubernetes' parser refuses (whitespace included).
    """
    match = _GRAMMAR.fullmatch(text)
    if match is None or not (match["whole"] or match["fraction"]):
        raise QuantityError(f"{text!r} is not a Kubernetes quantity (like 200Gi, 1e11 or 0.5Ti)")
    fraction = match["fraction"] or ""
    if len(match["whole"]) + len(fraction) > _MAX_DIGITS:
        raise QuantityError(f"{text[:40]!r}... has more than {_MAX_DIGITS} digits")
    magnitude = Fraction(int(match["whole"] + fraction), 10 ** len(fraction))
    binary = match["binary"]
    if binary:
        magnitude *= 2 ** _BINARY[binary]
    else:
        exponent = int(match["exponent"][1:]) if match["exponent"] else 0
        exponent += _DECIMAL.get(match["decimal"] or "", 0)
        if abs(exponent) > MAX_EXPONENT:
            raise QuantityError(
                f"{text!r} has a decimal exponent beyond {MAX_EXPONENT}: too large or too small "
                "for any quantity preshard reads"
            )
        magnitude *= Fraction(10) ** exponent
    if magnitude:
        magnitude = Fraction(math.ceil(magnitude * _NANO), _NANO)
    if binary and magnitude > MAX_BINARY:
        magnitude = Fraction(MAX_BINARY)
    return -magnitude if match["sign"] == "-" else magnitude


def whole_bytes(text: str) -> int:
    """The number of whole bytes a size quantity holds: at least 1, rounded down.

    Rounded down because a size is a bound: a 1.5-byte `emptyDir` limit holds one byte. Raises
    QuantityError for what is not a quantity, and for sizes under one byte (`0`, `-5Gi`, `1m`).
    """
    value = parse_quantity(text)
    count = math.floor(value)
    if count < 1:
        raise QuantityError(f"{text!r} is less than one byte")
    return count
