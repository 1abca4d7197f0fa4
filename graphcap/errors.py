"""The error every file graphcap reads raises when the file is malformed (capture specs, manifests): one base class,
one message shape `<file>: <field>: <reason>`, and the translation of a pydantic `ValidationError` into it."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class GraphcapInputError(ValueError):
    """A file graphcap reads is malformed. `str(err)` is `<file>: <field>: <reason>`; the three parts are attributes."""

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source, self.field, self.reason = source, field, reason
        super().__init__(f"{source}: {field}: {reason}")

    @classmethod
    def from_validation(cls, source: str, err: ValidationError, *, table: str = "a table",
                        extra: str = "unknown key") -> GraphcapInputError:
        """The first problem pydantic found, as `cls(source, dotted.field[i], reason)`. `table` and `extra` are the
        file format's words for a nested mapping and for a key the schema does not have."""
        e = err.errors(include_url=False)[0]
        kind, given = e["type"], e.get("input")
        if kind == "missing":
            reason = "missing"
        elif kind in ("extra_forbidden", "unexpected_keyword_argument"):
            reason = extra
        elif kind == "literal_error":
            reason = f"unknown value {_show(given)}; expected {e['ctx']['expected']}"
        else:
            ctx = e.get("ctx", {})
            want = _WANTS.get(kind) or e["msg"]
            if kind in ("dataclass_type", "model_type", "dict_type"):
                want = f"expected {table}"
            elif kind in ("greater_than_equal", "greater_than"):
                want = f"must be {'>=' if kind == 'greater_than_equal' else '>'} {ctx.get('ge', ctx.get('gt'))}"
            elif kind == "value_error":  # a validator's own ValueError: its message is the reason
                want = str(ctx.get("error", e["msg"]))
            elif kind == "too_short" and ctx.get("min_length") == 1:
                want = "expected a non-empty list"
            reason = f"{want}, got {_show(given)}"
        return cls(source, dotted(e["loc"]), reason)


_WANTS = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "bool_type": "expected true or false",
    "finite_number": "expected a finite number",
}


def dotted(loc: tuple[Any, ...]) -> str:
    """A pydantic location as the file's path: `('draft', 'layers', 1)` -> `draft.layers[1]`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _show(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."
