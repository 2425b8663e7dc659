"""CalculatorTool: arithmetic by AST walk; refusals and arithmetic errors are observations."""

import asyncio

import pytest

from mcore_agentic.tools.calculator import CalculatorTool

SCHEMA = {"type": "function", "function": {"name": "calculator"}}


def _calc(expression, **config):
    return asyncio.run(CalculatorTool(config, SCHEMA).execute("i", {"expression": expression}))


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-(4 - 10) // 4", "1"),
        ("7 % 3 + 2 ** 10", "1025"),
        ("+5 - -5", "10"),
        ("10 / 4", "2.5"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** -1", "0.5"),
        ("2 ** 0.5", "1.41421356237"),
        ("1e3 * 3", "3000"),
        ("123456789 * 987654321", "121932631112635269"),
    ],
)
def test_arithmetic(expression, expected):
    result = _calc(expression)
    assert not result.is_error and result.text == expected


@pytest.mark.parametrize(
    "expression, text",
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1 +", "invalid expression"),
        ("x + 1", "names like 'x' are not allowed"),
        ("__import__('os').system('ls')", "function calls are not allowed"),
        ("(1).real", "'Attribute' is not allowed"),
        ("[1, 2][0]", "'Subscript' is not allowed"),
        ("1 < 2", "'Compare' is not allowed"),
        ("'ab' * 3", "'ab' is not a number"),
        ("True + 1", "True is not a number"),
        ("1j * 2", "1j is not a number"),
        ("9 ** 9 ** 9", "result too large"),
        ("(10 ** 1000) * (10 ** 1000)", "result too large"),
        ("10.0 ** 400", "result too large"),
        ("(-8) ** (1 / 3)", "not a real number"),
        ("1" + "+1" * 300, "more than 200 operations"),
        ("(" * 300 + "1" + ")" * 300, "invalid expression"),
        ("1" * 2000, "longer than 1000 characters"),
    ],
)
def test_refusals_are_observations(expression, text):
    result = _calc(expression)
    assert result.is_error and result.text.startswith("Error: ")
    assert text in result.text, result.text


def test_bad_parameters():
    tool = CalculatorTool({}, SCHEMA)
    assert asyncio.run(tool.execute("i", {})).is_error
    assert asyncio.run(tool.execute("i", {"expression": "   "})).is_error
    assert asyncio.run(tool.execute("i", {"expression": 12})).text == "12"  # a bare number is tolerated
    assert _calc("2 ** 20", max_result_bits=8).is_error
