"""Reading the task families' data files: one reader and one record check for every loader.

Every error is a :class:`DataFileError` (a ``ValueError``) that names the file, the place in it
and what is wrong:

- a ``.jsonl`` file (:func:`read_jsonl`): the physical line number (from 1, blank lines counted)
  and, for bad JSON, the column and the parser's message; a line that is not valid UTF-8 is
  reported the same way;
- a ``.json`` file (:func:`read_json`): bad JSON by line and column; a record inside it by its
  JSON path (``data[3].paragraphs[0]``), since a JSON document has no line per record;
- a record without a required field, or with one of the wrong type (:func:`check_fields`): the
  place and the field's name.

This module has no dependencies beyond the standard library (lm-eval loads task helpers by path
as well as by import).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

__all__ = ["DataFileError", "Located", "check_fields", "read_json", "read_jsonl", "read_text", "where_of"]

_TYPE_NAMES = {str: "a string", list: "a list", dict: "an object", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}


class DataFileError(ValueError):
    """A task's data file cannot be used; the message names the file, the place and the problem."""


class Located(dict):
    """A record (a ``dict``) that knows where it was read: ``record.where`` is
    ``"<file>, line N"`` or ``"<file>, <JSON path>"``."""

    where: str = "a record"

    @classmethod
    def at(cls, record: dict[str, Any], where: str) -> "Located":
        out = cls(record)
        out.where = where
        return out


def where_of(record: Any, default: str) -> str:
    """``record.where`` for a :class:`Located` record, else ``default``."""
    return getattr(record, "where", None) or default


def read_jsonl(path: str | Path) -> list[Located]:
    """The JSON objects of a ``.jsonl`` file, one per non-blank line, each a :class:`Located`."""
    path = Path(path)
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataFileError(f"{path}, line {number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at "
                                    f"column {err.start + 1})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFileError(f"{path}, line {number}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(value, dict):
                raise DataFileError(f"{path}, line {number}: expected a JSON object, got {_type_name(value)}")
            records.append(Located.at(value, f"{path}, line {number}"))
    return records


def read_json(path: str | Path, expect: type | None = None) -> Any:
    """The JSON document of ``path`` (bad JSON named by line and column); ``expect`` (``dict`` or
    ``list``) checks its top level."""
    path = Path(path)
    text = read_text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataFileError(f"{path}, line {err.lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
    if expect is not None and not isinstance(value, expect):
        raise DataFileError(f"{path}: expected {_TYPE_NAMES[expect]} at the top level, got {_type_name(value)}")
    return value


def read_text(path: str | Path) -> str:
    """The UTF-8 text of ``path``; a byte that is not UTF-8 is named by line."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataFileError(f"{path}, line {line}: not UTF-8 text (byte 0x{raw[err.start]:02x})") from None


def check_fields(record: Any, fields: dict[str, Any], where: str) -> dict[str, Any]:
    """``record`` if it is an object holding every field of ``fields`` with the given type.

    A type is a Python type (``str``, ``list``, ``dict``, ``int``), a tuple of them, or ``[T]``
    for a list whose items are all ``T``. ``bool`` never passes for ``int``. Raises
    :class:`DataFileError` naming ``where`` and the field."""
    if not isinstance(record, dict):
        raise DataFileError(f"{where}: expected a JSON object, got {_type_name(record)}")
    for name, kind in fields.items():
        if name not in record:
            raise DataFileError(f"{where}: the record has no field {name!r} (it has {sorted(record)[:12]})")
        value = record[name]
        if isinstance(kind, list):
            (item,) = kind
            if not isinstance(value, list):
                raise DataFileError(f"{where}: field {name!r} must be a list, got {_type_name(value)}")
            for i, v in enumerate(value):
                if not _is(v, item):
                    raise DataFileError(f"{where}: field {name!r}[{i}] must be {_names(item)}, got {_type_name(v)}")
                _check_text(v, f"{name!r}[{i}]", where)
        elif not _is(value, kind):
            raise DataFileError(f"{where}: field {name!r} must be {_names(kind)}, got {_type_name(value)}")
        else:
            _check_text(value, repr(name), where)
    return record


def _check_text(value: Any, field: str, where: str) -> None:
    """A string must be valid Unicode: JSON's ``\\ud800`` escapes can spell a lone surrogate, which
    no tokenizer accepts."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataFileError(f"{where}: field {field} holds a lone surrogate (U+{ord(value[err.start]):04X}) at "
                                f"character {err.start}: not valid Unicode text") from None


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


def _names(kind: type | Iterable[type]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)


def _type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)
