"""Prompt templates, output specs, item keys and packing: the pure part of the labelling pipeline.

A template is a shared `prefix` (instructions, few-shot; identical bytes for every item so engines and
providers can reuse its KV / prompt cache) and a per-item part, a `str.format` string over the input
columns (`"State:\\n{compact_text}\\nAction:"`). The output is free text or a JSON object validated against
a small JSON-Schema subset (object/properties/required, string/integer/number/boolean/array/object, enum).

Packing puts K items in one request as a numbered list and asks for a JSON list of K answers back; each
answer is validated on its own, and a malformed or missing one is re-asked alone by the caller.
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from thinkcraft.utils.errors import UserError

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def validate(value: Any, schema: Mapping[str, Any], path: str = "$") -> list[str]:
    """Errors of `value` against a JSON-Schema subset (empty list = valid)."""
    errs: list[str] = []
    t = schema.get("type")
    if t is not None:
        types = [t] if isinstance(t, str) else list(t)
        ok = False
        for name in types:
            py = _TYPES.get(name)
            if py is None:
                raise UserError(f"schema at {path}: unsupported type {name!r} (use one of {sorted(_TYPES)})")
            # bool is an int in Python but not in JSON Schema
            if isinstance(value, py) and not (name in ("integer", "number") and isinstance(value, bool)):
                ok = True
        if not ok:
            return [f"{path}: expected {t}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not one of {schema['enum']}")
    if isinstance(value, dict):
        for req in schema.get("required", ()):
            if req not in value:
                errs.append(f"{path}: missing field {req!r}")
        props = schema.get("properties", {})
        for k, sub in props.items():
            if k in value:
                errs.extend(validate(value[k], sub, f"{path}.{k}"))
        if schema.get("additionalProperties") is False:
            extra = sorted(set(value) - set(props))
            if extra:
                errs.append(f"{path}: unexpected fields {extra}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errs.extend(validate(v, schema["items"], f"{path}[{i}]"))
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errs.append(f"{path}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errs.append(f"{path}: longer than {schema['maxLength']}")
    return errs


def schema_from_fields(fields: str) -> dict[str, Any]:
    """`"action:string,subgoal:string,confidence:number"` -> an object schema requiring those fields.

    A type may be an enum written `a|b|c` (`"move:left|right|up|down"`)."""
    props: dict[str, Any] = {}
    for part in [p.strip() for p in fields.split(",") if p.strip()]:
        name, _, typ = part.partition(":")
        name, typ = name.strip(), (typ.strip() or "string")
        if not name.isidentifier():
            raise UserError(f"--fields: {name!r} is not a valid field name")
        if "|" in typ:
            props[name] = {"type": "string", "enum": [v.strip() for v in typ.split("|")]}
        elif typ in _TYPES:
            props[name] = {"type": typ}
        else:
            raise UserError(f"--fields: field {name!r} has unknown type {typ!r} (use {sorted(_TYPES)} or a|b|c)")
    if not props:
        raise UserError("--fields: no fields given")
    return {"type": "object", "properties": props, "required": list(props)}


@dataclass(frozen=True)
class OutputSpec:
    schema: Mapping[str, Any] | None = None
    """None = free text; else the JSON object every answer must satisfy."""

    @property
    def is_json(self) -> bool:
        return self.schema is not None

    def describe(self) -> str:
        """One line for the prompt telling the model what shape to answer in."""
        if self.schema is None:
            return ""
        props = self.schema.get("properties", {})
        shape = ", ".join(f'"{k}": <{_describe_type(v)}>' for k, v in props.items())
        return "{" + shape + "}"


def _describe_type(s: Mapping[str, Any]) -> str:
    if "enum" in s:
        return " | ".join(json.dumps(v) for v in s["enum"])
    t = s.get("type", "any")
    return t if isinstance(t, str) else "/".join(t)


class Parsed(NamedTuple):
    value: Any
    """The parsed answer (a string for free text, a dict for JSON); None when invalid."""
    error: str | None


def parse_output(text: str, spec: OutputSpec) -> Parsed:
    """Free text is always valid (stripped); JSON: the first JSON object in the text that parses."""
    if not spec.is_json:
        return Parsed(text.strip(), None)
    obj = _first_json(text, "{")
    if obj is _MISSING:
        return Parsed(None, "no JSON object in the answer")
    errs = validate(obj, spec.schema)  # type: ignore[arg-type]
    return Parsed(obj, None) if not errs else Parsed(None, "; ".join(errs))


_MISSING = object()


def _first_json(text: str, opener: str) -> Any:
    """First JSON value starting at an `opener` character that decodes (models wrap JSON in prose/fences)."""
    dec = json.JSONDecoder()
    i = text.find(opener)
    while i != -1:
        try:
            obj, _ = dec.raw_decode(text, i)
            return obj
        except json.JSONDecodeError:
            i = text.find(opener, i + 1)
    return _MISSING


@dataclass(frozen=True)
class Template:
    prefix: str
    """Shared prefix, identical for every item (prefilled once / provider-cached)."""
    item: str = "{text}"
    """Per-item part: a `str.format` string over input column names."""
    output: OutputSpec = field(default_factory=OutputSpec)

    def __post_init__(self) -> None:
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(self.item) if f is not None]
        except ValueError as e:  # "{text" / "text}": unbalanced braces
            raise UserError(f"template item {self.item!r} is not a valid format string ({e}); write columns as "
                            "'{column}' and literal braces as '{{' and '}}'") from None
        if not names:
            raise UserError(f"template item {self.item!r} uses no input column; write e.g. '{{text}}'")
        positional = [n for n in names if not n or n.split(".")[0].split("[")[0].isdigit()]
        if positional:
            raise UserError(f"template item {self.item!r} has a positional field '{{{positional[0]}}}'; "
                            "name an input column, e.g. '{text}'")

    @property
    def columns(self) -> list[str]:
        return [f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(self.item) if f]

    @property
    def instructions(self) -> str:
        """The prefix plus the output-shape line: what every single-item request starts with."""
        if not self.output.is_json:
            return self.prefix
        sep = "" if not self.prefix or self.prefix.endswith("\n") else "\n"
        return f"{self.prefix}{sep}Answer with only a JSON object of the form {self.output.describe()}.\n"

    def render_item(self, row: Mapping[str, Any]) -> str:
        try:
            return self.item.format_map(row)
        except KeyError as e:
            raise UserError(f"template item uses column {e.args[0]!r}; the input has {sorted(row)}") from None
        except (IndexError, AttributeError, ValueError, TypeError) as e:  # "{text[3]}", "{text.x}", "{text:d}"
            raise UserError(f"template item {self.item!r} cannot be filled from the input: {e}") from None

    def digest(self) -> str:
        """Identity of the template for item keys: changing the prompt or output spec relabels."""
        blob = json.dumps({"prefix": self.prefix, "item": self.item, "schema": self.output.schema}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def item_key(prompt: str, model: str, template_digest: str) -> str:
    """Key of one item = hash of (full prompt, model, template). Re-runs skip keys already stored."""
    h = hashlib.sha256()
    for part in (prompt, model, template_digest):
        h.update(part.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()[:32]


def load_template(path: str | Path) -> Template:
    """A TOML or JSON file with `prefix`, `item`, and optionally `schema` (object) or `fields` (string)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--template: {p} does not exist")
    try:
        raw = p.read_text(encoding="utf-8")
        if p.suffix == ".json":
            d = json.loads(raw)
        else:
            import tomllib

            d = tomllib.loads(raw)
    except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise UserError(f"--template {p}: not valid {kind}: {e}") from None
    if not isinstance(d, dict):
        raise UserError(f"--template {p}: expected a table/object with prefix, item, schema or fields")
    unknown = set(d) - {"prefix", "item", "schema", "fields"}
    if unknown:
        raise UserError(f"--template {p}: unknown keys {sorted(unknown)} (expected prefix, item, schema, fields)")
    for k in ("prefix", "item", "fields"):
        if k in d and not isinstance(d[k], str):
            raise UserError(f"--template {p}: {k} must be a string, got {type(d[k]).__name__}")
    if d.get("schema") is not None and d.get("fields"):
        raise UserError(f"--template {p}: give schema or fields, not both")
    schema = d.get("schema")
    if d.get("fields"):
        schema = schema_from_fields(d["fields"])
    if schema is not None:
        check_schema(schema, f"--template {p}: schema")
    return Template(prefix=d.get("prefix", ""), item=d.get("item", "{text}"), output=OutputSpec(schema))


def check_schema(schema: Any, where: str = "--schema") -> None:
    """One-line UserError unless `schema` is an object schema within the subset `validate` checks."""
    if not isinstance(schema, dict):
        raise UserError(f"{where}: must be a JSON object (a JSON Schema), got {type(schema).__name__}")
    if schema.get("type") != "object":
        raise UserError(f"{where}: the answer must be an object: set \"type\": \"object\" at the top")
    _check_types(schema, where, "$")


def _check_types(schema: Any, where: str, path: str) -> None:
    if not isinstance(schema, dict):
        raise UserError(f"{where} at {path}: expected a schema object, got {schema!r}")
    t = schema.get("type")
    for name in ([t] if isinstance(t, str) else list(t or [])):
        if name not in _TYPES:
            raise UserError(f"{where} at {path}: unsupported type {name!r} (use one of {sorted(_TYPES)})")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise UserError(f"{where} at {path}: properties must be an object")
    for k, sub in props.items():
        _check_types(sub, where, f"{path}.{k}")
    req = schema.get("required", [])
    if not isinstance(req, list) or any(r not in props for r in req if props):
        raise UserError(f"{where} at {path}: required must list names from properties")
    if "items" in schema:
        _check_types(schema["items"], where, f"{path}[]")


def response_format(schema: dict[str, Any], name: str = "label") -> dict[str, Any]:
    """OpenAI structured outputs for an object schema (also what vLLM's and SGLang's servers accept).
    `strict` (OpenAI's exact mode) needs every property required and no extra properties: it is on when
    the schema has every property required, with `additionalProperties: false` added where unset."""
    import copy

    out = copy.deepcopy(schema)
    strict = True

    def walk(s: Any) -> None:
        nonlocal strict
        if not isinstance(s, dict):
            return
        props = s.get("properties")
        if isinstance(props, dict):
            if set(s.get("required", [])) != set(props):
                strict = False
            s.setdefault("additionalProperties", False)
            for sub in props.values():
                walk(sub)
        if "items" in s:
            walk(s["items"])

    walk(out)
    return {"type": "json_schema", "json_schema": {"name": name, "schema": out if strict else schema, "strict": strict}}


# --- packing: K items per request ---------------------------------------------------------------


def pack_prompt(template: Template, item_texts: Sequence[str]) -> str:
    """User message of a packed request: numbered items, JSON list of K answers out (prefix sent apart)."""
    k = len(item_texts)
    if template.output.is_json:
        shape = '{"id": <item number>, ' + template.output.describe()[1:]
    else:
        shape = '{"id": <item number>, "output": <your answer as a string>}'
    lines = [
        f"There are {k} items below, numbered 1 to {k}. Answer each one separately.",
        f"Reply with only a JSON list of {k} objects, in order, each of the form {shape}.",
        "",
    ]
    for i, t in enumerate(item_texts, 1):
        lines += [f"### Item {i}", t, ""]
    return "\n".join(lines)


def parse_packed(text: str, k: int, spec: OutputSpec) -> list[Parsed]:
    """One `Parsed` per item (position i = item i+1); a missing or invalid answer gets an error."""
    out = [Parsed(None, "missing from the packed answer")] * k
    arr = _first_json(text, "[")
    if arr is _MISSING or not isinstance(arr, list):
        return [Parsed(None, "no JSON list in the packed answer")] * k
    have_ids = all(isinstance(e, dict) and isinstance(e.get("id"), int) for e in arr)
    for pos, entry in enumerate(arr):
        idx = entry["id"] - 1 if have_ids else pos
        if not 0 <= idx < k or out[idx].error is None:
            continue  # out-of-range or duplicate id: ignore, the item is re-asked if still missing
        if isinstance(entry, dict):
            entry = {kk: v for kk, v in entry.items() if kk != "id"}
        if spec.is_json:
            errs = validate(entry, spec.schema)  # type: ignore[arg-type]
            out[idx] = Parsed(entry, None) if not errs else Parsed(None, "; ".join(errs))
        else:
            val = entry.get("output") if isinstance(entry, dict) else entry
            out[idx] = Parsed(val.strip(), None) if isinstance(val, str) else Parsed(None, "answer is not a string")
    return out
