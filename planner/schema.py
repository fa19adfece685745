"""A small JSON Schema validator, and the schema of plan files that ships with :mod:`planner`.

It checks the subset of JSON Schema (draft 2020-12) that ``plan.schema.json`` uses: ``type`` (a name or a list of
names), ``enum``, ``minimum``, ``required``, ``properties``, ``additionalProperties`` (a boolean or a schema) and
``items``. Other keywords (``$schema``, ``title``, ``description``) are annotations and are ignored. The first
violation raises :class:`~planner.errors.PlannerError` naming its JSON path (``$.regions[0].start``).

>>> schema = {"type": "object", "required": ["size"], "additionalProperties": False,
...           "properties": {"size": {"type": "integer", "minimum": 0},
...                          "tags": {"type": "array", "items": {"type": "string"}}}}
>>> validate({"size": 3, "tags": ["a"]}, schema)
>>> validate({"size": 3, "tags": ["a", 7]}, schema)
Traceback (most recent call last):
...
planner.errors.PlannerError: data is malformed at $.tags[1]: expected string, got integer 7
>>> validate({"size": -1}, schema, subject="plan")
Traceback (most recent call last):
...
planner.errors.PlannerError: plan data is malformed at $.size: -1 is below the minimum 0
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
from typing import Any

from .errors import PlannerError

PLAN_SCHEMA_FILE = "plan.schema.json"

def json_type(value: Any) -> str:
    """The JSON Schema type name of a value read by :func:`json.loads` (``"integer"`` for ``3``, not ``"number"``).

    >>> [json_type(v) for v in (None, True, 3, 2.5, "x", [], {})]
    ['null', 'boolean', 'integer', 'number', 'string', 'array', 'object']
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number" if math.isfinite(value) else "non-finite number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _has_type(value: Any, name: str) -> bool:
    found = json_type(value)
    return found == name or (name == "number" and found == "integer")


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``1 == 1.0`` holds, ``1 == true`` does not."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


class _Invalid(Exception):
    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


def _describe(value: Any) -> str:
    """The type of ``value`` and, for a scalar, a short rendering: ``string "0"``, ``integer 7``."""
    kind = json_type(value)
    if kind not in ("boolean", "integer", "number", "string"):
        return kind
    text = json.dumps(value)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _check_type(value: Any, schema: dict, path: str) -> None:
    names = schema.get("type")
    if names is None:
        return
    names = [names] if isinstance(names, str) else list(names)
    if not any(_has_type(value, n) for n in names):
        raise _Invalid(path, f"expected {' or '.join(names)}, got {_describe(value)}")


def _check_scalar(value: Any, schema: dict, path: str) -> None:
    if "enum" in schema and not any(_same(value, option) for option in schema["enum"]):
        allowed = ", ".join(json.dumps(option) for option in schema["enum"])
        raise _Invalid(path, f"{json.dumps(value)} is not one of {allowed}")
    if "minimum" in schema and json_type(value) in ("integer", "number") and value < schema["minimum"]:
        raise _Invalid(path, f"{value!r} is below the minimum {schema['minimum']!r}")


def _check_object(value: dict, schema: dict, path: str) -> None:
    missing = [name for name in schema.get("required", ()) if name not in value]
    if missing:
        raise _Invalid(f"{path}.{missing[0]}", "required field is missing")
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    unknown = sorted(name for name in value if name not in properties)
    if unknown and extra is False:
        raise _Invalid(path, f"unknown fields {unknown}")
    for name, item in value.items():
        sub = properties.get(name, extra if isinstance(extra, dict) else {})
        _check(item, sub, f"{path}.{name}")


def _check(value: Any, schema: dict, path: str) -> None:
    _check_type(value, schema, path)
    _check_scalar(value, schema, path)
    if isinstance(value, dict):
        _check_object(value, schema, path)
    elif isinstance(value, (list, tuple)) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]")


def validate(instance: Any, schema: dict, *, subject: str = "") -> None:
    """Check ``instance`` against ``schema``; raise :class:`PlannerError` naming the path of the first violation.

    Parameters
    ----------
    instance : a value as :func:`json.loads` returns it.
    schema : a JSON Schema using only the keywords listed in the module docstring.
    subject : what the data is (``"plan"``), for the message.

    Raises
    ------
    PlannerError
        ``"<subject> data is malformed at <path>: <problem>"``; ``path`` starts at ``$``.

    Examples
    --------
    >>> validate({"status": "done"}, {"properties": {"status": {"enum": ["optimal", "feasible"]}}})
    Traceback (most recent call last):
    ...
    planner.errors.PlannerError: data is malformed at $.status: "done" is not one of "optimal", "feasible"
    >>> validate({}, {"required": ["status"]}, subject="plan")
    Traceback (most recent call last):
    ...
    planner.errors.PlannerError: plan data is malformed at $.status: required field is missing
    """
    try:
        _check(instance, schema, "$")
    except _Invalid as bad:
        prefix = f"{subject} data" if subject else "data"
        raise PlannerError(f"{prefix} is malformed at {bad.path}: {bad.problem}") from None


@functools.cache
def _plan_schema_text() -> str:
    return importlib.resources.files("planner").joinpath(PLAN_SCHEMA_FILE).read_text(encoding="utf-8")


def plan_schema() -> dict:
    """The JSON Schema of plan files (``planner/plan.schema.json``), as a fresh dict.

    >>> schema = plan_schema()
    >>> schema["properties"]["status"]["enum"]
    ['optimal', 'feasible', 'heuristic']
    """
    return json.loads(_plan_schema_text())
