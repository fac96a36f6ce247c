"""A profile override of the wrong type names the type expected and the hint that fits it."""

import pytest

from qkov_lib.profiles import profile_table, resolve


def test_a_wrong_type_gets_the_hint_of_the_type_expected():
    """A float for an integer setting is told how an integer is written, not how a list is; a scalar for a
    list setting is told the list syntax."""
    table = profile_table(dict(steps=10, ratios=[1.0, 10.0]), {}, {}, {})
    with pytest.raises(TypeError, match=r"integer, got float 1000\.0 \(an integer is written without a point or an exponent: -p steps 10\)"):
        resolve(table, "test", steps=1e3)
    with pytest.raises(TypeError, match=r"a non-empty list of numbers, got float 10\.0 \(a list on the command line"):
        resolve(table, "test", ratios=10.0)
