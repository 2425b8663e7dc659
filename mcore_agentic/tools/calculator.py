"""``CalculatorTool``: safe arithmetic on an expression string, by walking its ``ast`` — never ``eval``.

Allowed: int/float literals, ``+ - * / // % **``, unary ``+``/``-``,
parentheses. Everything else (names, calls, attributes, subscripts,
comparisons, strings, ...) is refused with a message the model can act on.
Sizes are bounded before computing: integer results over ``max_result_bits``,
over-long expressions or too many operations are refused, so ``9**9**9``
cannot stall the rollout.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any

from mcore_agentic.tools.base import BaseTool, ToolResponse, error_response
from mcore_agentic.utils.walk import build

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_HELP = "use numbers, + - * / // % ** and parentheses"


class CalculationError(ValueError):
    """A refusal or arithmetic failure; its message is shown to the model."""


@dataclass(frozen=True)
class CalculatorConfig:
    max_expression_chars: int = 1000
    max_operations: int = 200
    max_result_bits: int = 4096
    """Largest integer (in bits, ~1233 decimal digits) an operation may produce."""
    significant_digits: int = 12
    """Floats are shown with this many significant digits."""

    def __post_init__(self) -> None:
        from mcore_agentic.utils.errors import require

        for key in ("max_expression_chars", "max_operations", "max_result_bits", "significant_digits"):
            require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")


class SafeEvaluator:
    """Evaluate an arithmetic expression with bounded work. Raises :class:`CalculationError`."""

    def __init__(self, settings: CalculatorConfig):
        self.settings = settings

    def evaluate(self, expression: str) -> int | float:
        if len(expression) > self.settings.max_expression_chars:
            raise CalculationError(f"expression is longer than {self.settings.max_expression_chars} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as exc:
            raise CalculationError(f"invalid expression ({exc.msg}); {_HELP}") from None
        except (RecursionError, MemoryError, ValueError):
            raise CalculationError("expression is too deeply nested or malformed") from None
        operations = sum(isinstance(node, ast.BinOp | ast.UnaryOp) for node in ast.walk(tree))
        if operations > self.settings.max_operations:
            raise CalculationError(f"expression has more than {self.settings.max_operations} operations")
        try:
            return self._eval(tree.body)
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
        except OverflowError:
            raise CalculationError("result too large") from None
        except RecursionError:
            raise CalculationError("expression is too deeply nested") from None

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CalculationError(f"{value!r} is not a number; {_HELP}")
            return value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            self._check_size(node.op, left, right)
            result = _BINARY[type(node.op)](left, right)
            if isinstance(result, complex):
                raise CalculationError("result is not a real number (fractional power of a negative number)")
            if isinstance(result, float) and not math.isfinite(result):
                raise CalculationError("result too large")
            return result
        if isinstance(node, ast.Name):
            raise CalculationError(f"names like '{node.id}' are not allowed; {_HELP}")
        if isinstance(node, ast.Call):
            raise CalculationError(f"function calls are not allowed; {_HELP}")
        raise CalculationError(f"'{type(node).__name__}' is not allowed; {_HELP}")

    def _check_size(self, op: ast.operator, left: int | float, right: int | float) -> None:
        """Refuse integer work whose result would exceed ``max_result_bits`` before doing it."""
        limit = self.settings.max_result_bits
        if not (isinstance(left, int) and isinstance(right, int)):
            return  # float overflow raises or yields inf, both caught
        if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1 and left.bit_length() * right > limit:
            raise CalculationError(f"result too large (over {limit} bits)")
        if isinstance(op, ast.Mult) and left.bit_length() + right.bit_length() > limit:
            raise CalculationError(f"result too large (over {limit} bits)")

    def format(self, value: int | float) -> str:
        if isinstance(value, int):
            return str(value)
        return format(value, f".{self.settings.significant_digits}g")


class CalculatorTool(BaseTool):
    """Parameters ``{"expression": str}``; returns the value as text."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        super().__init__(config, tool_schema)
        self.settings: CalculatorConfig = build(CalculatorConfig, self.config, path="config")
        self.evaluator = SafeEvaluator(self.settings)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        expression = parameters.get("expression") if isinstance(parameters, dict) else None
        if isinstance(expression, int | float) and not isinstance(expression, bool):
            expression = repr(expression)
        if not isinstance(expression, str) or not expression.strip():
            return error_response(f"Error: tool '{self.name}' needs a non-empty string argument 'expression'.", bad_call=1)
        try:
            value = self.evaluator.evaluate(expression)
        except CalculationError as exc:
            return error_response(f"Error: {exc}.", bad_call=1)
        return ToolResponse(text=self.evaluator.format(value))
