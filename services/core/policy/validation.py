"""A small validator for the JSON Schema subset policy parameters use.

Supported: ``type`` (number, integer, boolean, string, object, null, or a list of them),
``minimum``, ``maximum``, ``exclusiveMinimum``, ``enum``, ``properties``,
``additionalProperties`` (false or a schema), ``default``. Unknown parameters are rejected.
Errors are :class:`PolicyError` with a dotted field path (``params.decode_weight``).
Returns the params with defaults filled in.
"""

from __future__ import annotations

from typing import Any

from services.core.policy.errors import PolicyError

_TYPES: dict[str, tuple[type, ...]] = {
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "string": (str,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, type_name: str) -> bool:
    if type_name in ("number", "integer") and isinstance(value, bool):
        return False
    if type_name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[type_name])


def check(value: Any, schema: dict[str, Any], path: str) -> Any:
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_type_ok(value, t) for t in names):
            raise PolicyError(path, f"must be {' or '.join(names)}, got {type(value).__name__}")
        if value is None:
            return None
    if "enum" in schema and value not in schema["enum"]:
        raise PolicyError(path, f"must be one of {schema['enum']}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise PolicyError(path, f"must be >= {schema['minimum']}, got {value}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise PolicyError(path, f"must be > {schema['exclusiveMinimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            raise PolicyError(path, f"must be <= {schema['maximum']}, got {value}")
        if schema.get("type") == "integer" and isinstance(value, float):
            value = int(value)
    if isinstance(value, str) and "maxLength" in schema and len(value) > schema["maxLength"]:
        raise PolicyError(path, f"must be at most {schema['maxLength']} characters")
    if isinstance(value, dict):
        value = _check_object(value, schema, path)
    return value


def _check_object(value: dict[str, Any], schema: dict[str, Any], path: str) -> dict[str, Any]:
    props: dict[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    out: dict[str, Any] = {}
    for key, item in value.items():
        sub = f"{path}.{key}" if path else str(key)
        if not isinstance(key, str):
            raise PolicyError(sub, "keys must be strings")
        if key in props:
            out[key] = check(item, props[key], sub)
        elif extra is False:
            known = ", ".join(sorted(props)) or "none"
            raise PolicyError(sub, f"unknown parameter (known: {known})")
        elif isinstance(extra, dict):
            out[key] = check(item, extra, sub)
        else:
            out[key] = item
    for key, sub_schema in props.items():
        if key not in out and "default" in sub_schema:
            out[key] = sub_schema["default"]
    for key in schema.get("required", ()):
        if key not in out:
            raise PolicyError(f"{path}.{key}" if path else key, "is required")
    return out
