"""How a value or a pydantic error is quoted in an error message."""

from __future__ import annotations

from pydantic import ValidationError


def clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def error_message(err: dict) -> str:
    """A pydantic error's message, with "must be a number" for NaN and infinity."""
    if err.get("type") == "finite_number":
        return "must be a number (NaN and infinity are not allowed)"
    return str(err.get("msg", "")).removeprefix("Value error, ")


def explain(err: ValidationError) -> str:
    return "invalid configuration: " + "; ".join(
        f"{str(e['loc'][0]).upper() if e['loc'] else '?'}={clip(repr(e.get('input')))}: "
        f"{error_message(e)}" for e in err.errors())
