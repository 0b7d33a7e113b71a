"""Frozen records validated once, at construction: what zplan's specs and plan file need of a
validation library, in plain Python.

Why not pydantic (which zplan used until 2026-12): importing it and building the specs' validators
took ~200 ms of `zplan estimate`, whose budget is 0.3 s (issue 8), for about ten validations a
command. The semantics are pydantic 2's lax mode as zplan used it, so files valid before are valid
now and errors read the same (`errors()` gives loc, msg, type and input):

- fields come from class annotations, resolved on first use (`from __future__ import
  annotations` keeps them strings until then); a default is a plain value or `Field(default)`;
- types: bool, int, float, str, Literal, `X | None`, dict[K, V], list[X], tuple[X, ...],
  tuple[A, B, C], a nested Record (a dict or an instance), Annotated[T, Field(...)] for bounds
  (a string's pattern must match the whole string);
- int takes an int, an integral float or a string of ASCII digits (`1_000`, `8.0`); float takes
  an int, a float or a number's string in ASCII digits (finite unless the class allows inf and
  NaN); neither takes a bool (pydantic took True as 1: a mistake in a spec file); bool takes a
  bool, 0 or 1, or true/false, yes/no, on/off, t/f, y/n as text; Unicode spaces around a number
  are stripped; no string may hold a lone surrogate; inputs only Python code makes (bytes,
  Decimal, enums, sets; pydantic took some) are refused: files give none of them;
- unknown fields are refused, missing required ones named; the first error in field order is
  reported (model validators run only on valid fields, as pydantic's do);
- `model_copy(update=...)` copies without validating, as pydantic's does; defaults are not
  validated either, and an unhashable one is copied for each record; JSON writes a non-finite
  float as null; equality, hashing and dumps read the fields only.

tests/test_validated.py holds each rule.
"""

from __future__ import annotations

import copy
import json
import math
import re
import types
import typing
from typing import Any, Annotated, Callable, Literal, Union, get_args, get_origin

_MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "<required>"})()


class Field:
    """A field's default, bounds and description (pydantic's Field, the parts zplan uses)."""

    __slots__ = ("default", "gt", "ge", "lt", "le", "min_length", "max_length", "pattern",
                 "description", "exclude")

    def __init__(self, default: Any = _MISSING, *, gt: float | None = None, ge: float | None = None,
                 lt: float | None = None, le: float | None = None, min_length: int | None = None,
                 max_length: int | None = None, pattern: str | None = None, description: str = "",
                 exclude: bool = False) -> None:
        self.default, self.description, self.exclude = default, description, exclude
        self.gt, self.ge, self.lt, self.le = gt, ge, lt, le
        self.min_length, self.max_length, self.pattern = min_length, max_length, pattern

    def is_required(self) -> bool:
        return self.default is _MISSING


_HASH = "__zplan_hash__"  # where a record keeps its hash once computed (not a field)
_BOUNDS = ("gt", "ge", "lt", "le", "min_length", "max_length", "pattern")


class ValidationError(ValueError):
    """Why data is not a valid record: `errors()` as pydantic's, the first error found."""

    def __init__(self, title: str, errors: list[dict[str, Any]]) -> None:
        self.title, self._errors = title, errors
        e = errors[0]
        where = ".".join(str(x) for x in e["loc"])
        super().__init__(f"{len(errors)} validation error for {title}\n{where}\n  {e['msg']} "
                         f"[type={e['type']}, input_value={e['input']!r:.80}]")

    def errors(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self._errors]


class _Invalid(Exception):
    """One error while validating; loc grows as it leaves nested values."""

    def __init__(self, msg: str, kind: str, value: Any, loc: tuple = ()) -> None:
        self.msg, self.kind, self.value, self.loc = msg, kind, value, loc

    def error(self, title: str) -> ValidationError:
        return ValidationError(title, [{"loc": self.loc, "msg": self.msg, "type": self.kind,
                                        "input": self.value}])


def model_validator(*, mode: str) -> Callable:
    """Mark a validator: mode "before" (a classmethod given the input dict, returning the dict to
    validate) or "after" (a method given the record, returning it); a ValueError it raises is
    reported as pydantic reports it ("Value error, ...")."""
    if mode not in ("before", "after"):
        raise ValueError(f"mode {mode!r}")

    def mark(fn: Any) -> Any:
        (fn.__func__ if isinstance(fn, classmethod) else fn).__record_validator__ = mode
        return fn
    return mark


def _number(v: Any) -> str:
    """A bound as pydantic prints it (Rust's f64 Display: no exponent for integral values)."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _choices(values: tuple) -> str:
    shown = [repr(v) for v in values]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def _bounds(f: Field, v: Any) -> None:
    """pydantic-core's order (le, lt, ge, gt): NaN, which fails them all, fails as it did."""
    if f.le is not None and not v <= f.le:
        raise _Invalid(f"Input should be less than or equal to {_number(f.le)}", "less_than_equal", v)
    if f.lt is not None and not v < f.lt:
        raise _Invalid(f"Input should be less than {_number(f.lt)}", "less_than", v)
    if f.ge is not None and not v >= f.ge:
        raise _Invalid(f"Input should be greater than or equal to {_number(f.ge)}", "greater_than_equal", v)
    if f.gt is not None and not v > f.gt:
        raise _Invalid(f"Input should be greater than {_number(f.gt)}", "greater_than", v)


def _text_bounds(f: Field, v: str) -> None:
    n = len(v)
    if f.min_length is not None and n < f.min_length:
        s = "" if f.min_length == 1 else "s"
        raise _Invalid(f"String should have at least {f.min_length} character{s}", "string_too_short", v)
    if f.max_length is not None and n > f.max_length:
        s = "" if f.max_length == 1 else "s"
        raise _Invalid(f"String should have at most {f.max_length} character{s}", "string_too_long", v)
    if f.pattern is not None and not re.fullmatch(f.pattern, v):
        raise _Invalid(f"String should match pattern '{f.pattern}'", "string_pattern_mismatch", v)


_INT_TEXT = re.compile(r"[+-]?[0-9]+(_[0-9]+)*(\.0+)?")  # ASCII digits; "8.0" is 8, as pydantic read it
# Unicode's White_Space, which pydantic-core (Rust's str::trim) strips around a number; Python's
# str.strip would also strip \x1c-\x1f, which pydantic refused
_SPACE = " \t\n\x0b\x0c\r\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008" \
         "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"


def _unicode(v: str) -> None:
    """A lone surrogate (JSON's "\ud800") is no text: it could never be written out again.
    pydantic refused it wherever a string was read, whatever the field's type."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise _Invalid("Input should be a valid string, unable to parse raw data as a unicode "
                       "string", "string_unicode", v) from None


def _numbers(a: Any, b: Any) -> bool:
    """Both plain numbers (int or float, never bool)."""
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))


def _to_int(v: Any) -> int:
    if isinstance(v, str):
        _unicode(v)
        text = v.strip(_SPACE)
        if _INT_TEXT.fullmatch(text) and len(text) < 4300:
            return int(text.partition(".")[0])
        raise _Invalid("Input should be a valid integer, unable to parse string as an integer",
                       "int_parsing", v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Invalid("Input should be a valid integer", "int_type", v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _Invalid("Input should be a finite number", "finite_number", v)
        if abs(v) >= 2**63:  # pydantic's integers are 64-bit
            raise _Invalid("Unable to parse input string as an integer, exceeded maximum size",
                           "int_parsing_size", v)
        if not v.is_integer():
            raise _Invalid("Input should be a valid integer, got a number with a fractional part",
                           "int_from_float", v)
        return int(v)
    return int(v)


def _float_check(finite: bool) -> Callable[[Any], float]:
    def to_float(v: Any) -> float:
        if isinstance(v, str):
            _unicode(v)
            text = v.strip(_SPACE)
            try:  # ASCII only: float() also reads other scripts' digits, which pydantic refused
                v2 = float(text) if text.isascii() else None
            except ValueError:
                v2 = None
            if v2 is None:
                raise _Invalid("Input should be a valid number, unable to parse string as a number",
                               "float_parsing", v)
            if finite and not math.isfinite(v2):
                raise _Invalid("Input should be a finite number", "finite_number", v)
            return v2
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Invalid("Input should be a valid number", "float_type", v)
        try:
            out = float(v)
        except OverflowError:
            raise _Invalid("Input should be a finite number", "finite_number", v) from None
        if finite and not math.isfinite(out):
            raise _Invalid("Input should be a finite number", "finite_number", v)
        return out
    return to_float


_BOOL_TEXT = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
              "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}


def _to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        _unicode(v)
    if isinstance(v, str) and v.lower() in _BOOL_TEXT:
        return _BOOL_TEXT[v.lower()]
    whole = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
    if isinstance(v, str) or (whole and abs(v) < 2**63):  # pydantic's wording, by input kind
        raise _Invalid("Input should be a valid boolean, unable to interpret input", "bool_parsing", v)
    raise _Invalid("Input should be a valid boolean", "bool_type", v)


def _in_loc(check: Callable[[Any], Any], key: Any) -> Callable[[Any], Any]:
    def run(v: Any) -> Any:
        try:
            return check(v)
        except _Invalid as e:
            e.loc = (key, *e.loc)
            raise
    return run


class _Compiler:
    """A type annotation -> a function that validates and converts one value."""

    def __init__(self, owner: type[Record]) -> None:
        self.owner = owner

    def __call__(self, tp: Any, bounds: Field | None = None) -> Callable[[Any], Any]:
        origin, args = get_origin(tp), get_args(tp)
        if origin is Annotated:
            return self(args[0], next((m for m in args[1:] if isinstance(m, Field)), bounds))
        check = self._plain(tp, origin, args)
        if bounds is None or not any(getattr(bounds, k) is not None for k in _BOUNDS):
            return check
        textual = tp is str

        def bounded(v: Any) -> Any:
            if textual and isinstance(v, str):  # the field's own length first, then the class's
                _unicode(v)
                _text_bounds(bounds, v)
            out = check(v)
            if out is not None:  # `X | None`: the bounds are X's
                try:
                    (_text_bounds if textual else _bounds)(bounds, out)
                except _Invalid as e:
                    e.value = v  # the input as given, as pydantic reports it
                    raise
            return out
        return bounded

    def _plain(self, tp: Any, origin: Any, args: tuple) -> Callable[[Any], Any]:
        owner = self.owner
        if tp is Any:
            return lambda v: v
        if tp is bool:
            return _to_bool
        if tp is int:
            return _to_int
        if tp is float:
            return _float_check(not owner.allow_inf_nan)
        if tp is str:
            limit = owner.str_max_length

            def to_str(v: Any) -> str:
                if not isinstance(v, str):
                    raise _Invalid("Input should be a valid string", "string_type", v)
                _unicode(v)
                if limit is not None and len(v) > limit:
                    raise _Invalid(f"String should have at most {limit} characters", "string_too_long", v)
                return v
            return to_str
        if origin is Literal:
            allowed = args
            textual = any(isinstance(a, str) for a in allowed)

            def literal(v: Any) -> Any:
                if textual and isinstance(v, str):
                    _unicode(v)
                for a in allowed:  # equal and of the same kind: True is not 1, 1.0 is (lax)
                    if v == a and (type(v) is type(a) or _numbers(v, a)):
                        return a
                raise _Invalid(f"Input should be {_choices(allowed)}", "literal_error", v)
            return literal
        if origin in (Union, types.UnionType):
            members = [a for a in args if a is not type(None)]
            if len(members) != 1 or len(args) != 2:
                raise TypeError(f"{owner.__name__}: only `X | None` unions are supported, not {tp}")
            inner = self(members[0])
            return lambda v: None if v is None else inner(v)
        if origin is dict:
            key, value = self(args[0]), self(args[1])

            def to_dict(v: Any) -> dict:
                if not isinstance(v, dict):
                    raise _Invalid("Input should be a valid dictionary", "dict_type", v)
                out = {}
                for k, x in v.items():
                    try:
                        k2 = key(k)
                    except _Invalid as e:
                        e.loc = (k, "[key]", *e.loc)
                        raise
                    out[k2] = _in_loc(value, k)(x)
                return out
            return to_dict
        if origin in (list, tuple):
            return self._sequence(origin, args)
        if isinstance(tp, type) and issubclass(tp, Record):
            return tp._coerce
        raise TypeError(f"{owner.__name__}: type {tp!r} is not supported")

    def _sequence(self, origin: type, args: tuple) -> Callable[[Any], Any]:
        variadic = origin is list or (len(args) == 2 and args[1] is Ellipsis)
        items = [self(args[0])] if variadic else [self(a) for a in args]
        name = "list" if origin is list else "tuple"

        def to_seq(v: Any) -> Any:
            if not isinstance(v, (list, tuple)):
                raise _Invalid(f"Input should be a valid {name}", f"{name}_type", v)
            out = [_in_loc(items[0] if variadic else items[i], i)(x)
                   for i, x in enumerate(v if variadic else v[:len(items)])]
            if not variadic and len(v) > len(items):
                raise _Invalid(f"Tuple should have at most {len(items)} items after validation, "
                               f"not {len(v)}", "too_long", v)
            if not variadic and len(v) < len(items):
                raise _Invalid("Field required", "missing", v, (len(v),))
            return out if origin is list else tuple(out)
        return to_seq


class Record:
    """A frozen record: fields from annotations, validated on construction, unknown ones refused.

    Class settings: `allow_inf_nan` (float fields may hold inf and NaN), `str_max_length` (every
    str field), `field_check` (a function each given field value passes through after its type's
    check; raising ValueError refuses it).
    """

    allow_inf_nan = True
    str_max_length: int | None = None
    field_check: Callable[[Any], Any] | None = None
    model_fields: dict[str, Field] = {}
    __compiled__: list[tuple[str, Callable[[Any], Any], Field]] | None = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        fields: dict[str, Field] = {}
        for base in reversed(cls.__mro__[1:]):
            fields.update(getattr(base, "model_fields", {}) if base is not Record else {})
        for name, ann in cls.__dict__.get("__annotations__", {}).items():
            if "ClassVar" in str(ann) or name.startswith("_"):
                continue
            given = cls.__dict__.get(name, _MISSING)
            f = given if isinstance(given, Field) else Field(given)
            if isinstance(given, Field):
                delattr(cls, name)  # the instance's value or AttributeError, never the Field
            fields[name] = f
        cls.model_fields = fields
        cls.__compiled__ = None
        befores, afters = [], []
        for klass in reversed(cls.__mro__):
            for attr, v in klass.__dict__.items():
                fn = v.__func__ if isinstance(v, classmethod) else v
                mode = getattr(fn, "__record_validator__", None)
                if mode:
                    (befores if mode == "before" else afters).append(attr)
        cls.__validators__ = (tuple(dict.fromkeys(befores)), tuple(dict.fromkeys(afters)))

    @classmethod
    def _compile(cls) -> list[tuple[str, Callable[[Any], Any], Field]]:
        hints = typing.get_type_hints(cls, include_extras=True)
        compiler = _Compiler(cls)
        cls.__compiled__ = [(n, compiler(hints[n], f), f) for n, f in cls.model_fields.items()]
        return cls.__compiled__

    def __init__(self, **data: Any) -> None:
        try:
            type(self)._fill(self, data)
        except _Invalid as e:
            raise e.error(type(self).__name__) from None

    @classmethod
    def model_validate(cls, data: Any) -> Record:
        """The record `data` describes (a dict), or `data` itself if it is one already."""
        if isinstance(data, cls):
            return data
        try:
            return cls._coerce(data)
        except _Invalid as e:
            raise e.error(cls.__name__) from None

    @classmethod
    def model_validate_json(cls, text: str | bytes) -> Record:
        """The record a JSON document describes (data, never code: json.loads)."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise _Invalid(f"Invalid JSON: {e}", "json_invalid", text).error(cls.__name__) from None
        return cls.model_validate(data)

    @classmethod
    def _coerce(cls, data: Any) -> Record:
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise _Invalid(f"Input should be a valid dictionary or instance of {cls.__name__}",
                           "model_type", data)
        return cls._fill(object.__new__(cls), data)

    @classmethod
    def _fill(cls, out: Record, data: dict) -> Record:
        """`out` given `data`'s validated fields, then checked by the "after" validators; a
        ValueError from a validator is an error of the whole record (loc ())."""
        try:
            out.__dict__.update(cls._values(data))
            return cls._run_after(out)
        except ValueError as e:
            raise _Invalid(f"Value error, {e}", "value_error", data) from None

    @classmethod
    def _run_after(cls, rec: Record) -> Record:
        for name in cls.__validators__[1]:
            out = getattr(rec, name)()
            if out is not rec:
                raise TypeError(f"{cls.__name__}.{name} must return the record")
        return rec

    @classmethod
    def _values(cls, data: dict) -> dict[str, Any]:
        """Every field's value from `data` (validated) or its default; _Invalid on the first error,
        ValueError from a "before" validator."""
        for name in cls.__validators__[0]:
            data = getattr(cls, name)(data)
        compiled = cls.__compiled__ if cls.__compiled__ is not None else cls._compile()
        check = cls.field_check
        out: dict[str, Any] = {}
        for name, convert, f in compiled:
            if name not in data:
                if f.default is _MISSING:
                    raise _Invalid("Field required", "missing", data, (name,))
                # an unhashable default (a dict, a list) is copied for each record, as pydantic did
                out[name] = f.default if _hashable(f.default) else copy.deepcopy(f.default)
                continue
            raw = data[name]
            try:
                v = convert(raw)
                if check is not None:
                    try:
                        v = check(v)
                    except ValueError as e:
                        raise _Invalid(f"Value error, {e}", "value_error", raw) from None
            except _Invalid as e:
                e.loc = (name, *e.loc)
                raise
            out[name] = v
        for name in data:
            if name not in out:
                raise _Invalid("Extra inputs are not permitted", "extra_forbidden", data[name], (name,))
        return out

    # ---------------------------------------------------------------- frozen value semantics

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: make a changed copy with "
                             f"model_copy(update={{{name!r}: ...}})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        if other is self:
            return True
        d, e = self.__dict__, other.__dict__  # fields only: a cached property is not one
        h, g = d.get(_HASH), e.get(_HASH)
        if h is not None and g is not None and h != g:
            return False
        return all(d[k] == e[k] for k in type(self).model_fields)

    def __hash__(self) -> int:
        # A record is frozen, so its hash is computed once: recommend hashes its training and
        # model specs (with their nested precision records) as cache keys tens of thousands of
        # times per search. model_copy and pickling drop the cached value. (A record with a
        # dict field, as a GPU's kernel table, is unhashable, as under pydantic.)
        d = self.__dict__
        h = d.get(_HASH)
        if h is None:
            h = d[_HASH] = hash((type(self), *(d[k] for k in type(self).model_fields)))
        return h

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and copied without the cached hash (a str's hash differs between processes)."""
        state = dict(self.__dict__)
        state.pop(_HASH, None)
        return state

    def __repr__(self) -> str:
        d = self.__dict__
        return f"{type(self).__name__}({', '.join(f'{k}={d[k]!r}' for k in type(self).model_fields)})"

    def model_copy(self, update: dict[str, Any] | None = None) -> Record:
        """A copy with `update`'s fields replaced, not validated (pydantic's model_copy)."""
        cls = type(self)
        unknown = set(update or ()) - cls.model_fields.keys()
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
        out = object.__new__(cls)
        out.__dict__.update(self.__dict__)
        out.__dict__.update(update or {})
        out.__dict__.pop(_HASH, None)  # the copy's fields may differ: its hash is its own
        return out

    def model_dump(self) -> dict[str, Any]:
        """Plain data: nested records as dicts, tuples as lists; fields marked exclude left out."""
        d = self.__dict__
        return {k: _dump(d[k]) for k, f in type(self).model_fields.items() if not f.exclude}

    def model_dump_json(self, indent: int | None = None) -> str:
        """JSON; a non-finite float is written null, as pydantic wrote it (JSON has no NaN)."""
        data = _finite(self.model_dump())
        if indent is None:
            return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return json.dumps(data, ensure_ascii=False, allow_nan=False, indent=indent)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _finite(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _dump(v: Any) -> Any:
    if isinstance(v, Record):
        return v.model_dump()
    if isinstance(v, dict):
        return {k: _dump(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_dump(x) for x in v]
    return v
