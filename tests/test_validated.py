"""zplan.validated: frozen records, validated as pydantic 2 (lax mode) validated zplan's specs.

The oracle is pydantic itself: the same classes declared both ways, one corpus of inputs through
each, the same accepted values and the same errors (field, kind, message); the rules where zplan
is stricter on purpose are tested on their own.
"""

from __future__ import annotations

import json
import math
import pickle
from typing import Annotated, Literal

import pytest

from zplan.validated import Field, Record, ValidationError, model_validator

pydantic = pytest.importorskip("pydantic")

Small = Annotated[int, Field(gt=0, le=256)]
Text = Annotated[str, Field(min_length=1, max_length=8, pattern=r"^[a-z]+$")]


class Inner(Record):
    kind: Literal["a", "b"] = "a"
    rate: float = Field(1.0, gt=0, le=1e18)


class Outer(Record):
    n: Small
    name: Text
    flag: bool = False
    frac: float | None = Field(None, ge=0, lt=1)
    count: int | None = Field(None, gt=0)
    rates: dict[Literal["x", "y"], Annotated[float, Field(gt=0)]] = {}
    triple: tuple[float, float, float] | None = None
    inners: tuple[Inner, ...] = ()
    inner: Inner = Inner()
    version: Literal[1] = 1


PSmall = Annotated[int, pydantic.Field(gt=0, le=256)]
PText = Annotated[str, pydantic.StringConstraints(min_length=1, max_length=8, pattern=r"^[a-z]+$")]
CONFIG = pydantic.ConfigDict(frozen=True, extra="forbid")


class PInner(pydantic.BaseModel):
    model_config = CONFIG
    kind: Literal["a", "b"] = "a"
    rate: float = pydantic.Field(1.0, gt=0, le=1e18)


class POuter(pydantic.BaseModel):
    model_config = CONFIG
    n: PSmall
    name: PText
    flag: bool = False
    frac: float | None = pydantic.Field(None, ge=0, lt=1)
    count: int | None = pydantic.Field(None, gt=0)
    rates: dict[Literal["x", "y"], Annotated[float, pydantic.Field(gt=0)]] = {}
    triple: tuple[float, float, float] | None = None
    inners: tuple[PInner, ...] = ()
    inner: PInner = PInner()
    version: Literal[1] = 1


GOOD = {"n": 8, "name": "abc"}
VALUES = [0, 1, -1, 7, 256, 257, 0.5, 1.0, 8.0, -0.0, 2.5e3, 1e30, float("nan"), float("inf"), "8", " 8 ",
          "1_000", "+5", "x", "", "abc", "ABC", "a\n", "abcdefghi", "true", "no", "yes", "off", "1e3",
          None, [], {}, [1.0, 2.0, 3.0], [1.0, 2.0], [1.0, 2.0, 3.0, 4.0], {"x": 1.0}, {"z": 1.0},
          {"x": 0}, {"x": "2"}, {"kind": "b"}, {"kind": "c"}, {"rate": 0}, [{"kind": "b"}], [{"rate": -1}],
          "a", "b", 1e20, "8.0", " 1.0", "8.", ".0", "\x1c8", "\u20038", "\xa08", "\uff15\uff10", "\u0665",
          "s\udc00", "x" * 5000, "9" * 30]


def corpus():
    for field in POuter.model_fields:
        for v in VALUES:
            yield {**GOOD, field: v}
        yield {k: v for k, v in GOOD.items() if k != field}
    yield {**GOOD, "extra": 1}
    yield GOOD


def outcome(cls, data):
    try:
        return "ok", json.dumps(cls.model_validate(data).model_dump(), sort_keys=True)
    except (ValidationError, pydantic.ValidationError) as e:
        first = e.errors()[0]
        return "error", ".".join(str(x) for x in first["loc"]), first["type"]


def test_same_answers_as_pydantic():
    for data in corpus():
        if any(isinstance(v, bool) for v in data.values()):
            continue
        mine, theirs = outcome(Outer, data), outcome(POuter, data)
        if theirs[0] == "error" and theirs[2] == "bool_parsing":
            assert mine[0] == "error" and mine[1] == theirs[1], data  # one message wording differs
            continue
        assert mine == theirs, data


def test_messages_read_as_pydantic():
    """zplan prints the first error's message (specs.validation_line); users saw pydantic's."""
    for data in ({**GOOD, "n": 0}, {**GOOD, "n": 300}, {**GOOD, "name": "ABC"}, {**GOOD, "frac": 1},
                 {**GOOD, "inner": {"kind": "c"}}, {"name": "abc"}, {**GOOD, "zz": 1},
                 {**GOOD, "n": "x"}, {**GOOD, "n": 2.5}, {**GOOD, "rates": {"z": 1.0}}):
        with pytest.raises(ValidationError) as mine:
            Outer.model_validate(data)
        with pytest.raises(pydantic.ValidationError) as theirs:
            POuter.model_validate(data)
        assert mine.value.errors()[0]["msg"] == theirs.value.errors()[0]["msg"], data


def test_stricter_than_pydantic_on_bools_for_numbers():
    """pydantic took True as 1 for a number; in a spec file that is a mistake, refused."""
    with pytest.raises(ValidationError, match="valid integer"):
        Outer(n=True, name="abc")
    assert POuter(n=True, name="abc").n == 1


def test_frozen_copy_equality_hash_pickle():
    a = Outer(n=3, name="abc", triple=[1, 2, 3], inners=[{"kind": "b"}])
    assert a.triple == (1.0, 2.0, 3.0) and isinstance(a.triple[0], float) and a.inners[0].kind == "b"
    with pytest.raises(AttributeError):
        a.n = 4
    b = a.model_copy(update={"n": 4})
    assert (a.n, b.n) == (3, 4) and b.name == "abc" and a != b and a == a.model_copy()
    assert hash(a.inners[0]) == hash(Inner(kind="b"))  # a dict field (rates) makes `a` unhashable, as in pydantic
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(TypeError, match="no field 'm'"):
        a.model_copy(update={"m": 1})
    dumped = a.model_dump()
    assert dumped["triple"] == [1.0, 2.0, 3.0] and dumped["inners"] == [{"kind": "b", "rate": 1.0}]
    assert Outer.model_validate(json.loads(a.model_dump_json(indent=2))) == a
    assert Outer.model_validate_json(a.model_dump_json()) == a
    with pytest.raises(ValidationError, match="Invalid JSON"):
        Outer.model_validate_json("{")
    assert Outer.model_validate(a) is a


def test_a_cached_hash_follows_the_fields():
    """A record's hash is computed once (recommend hashes records as cache keys): a copy with
    another field value hashes as a freshly validated record with it does, never as the
    original; equal records hash equal; the cached value is not pickled (a str's hash differs
    between processes)."""
    a = Inner(kind="b", rate=2.0)
    first = hash(a)
    assert hash(a) == first == hash(Inner(kind="b", rate=2.0))
    b = a.model_copy(update={"rate": 3.0})
    assert hash(b) == hash(Inner(kind="b", rate=3.0)) and b != a
    assert a.model_copy() == a and hash(a.model_copy()) == first
    state = a.__getstate__()
    assert set(state) == {"kind", "rate"} and pickle.loads(pickle.dumps(a)) == a


class Checked(Record):
    allow_inf_nan = False
    str_max_length = 5
    field_check = staticmethod(lambda v: v if not (isinstance(v, float) and v > 100) else
                               (_ for _ in ()).throw(ValueError(f"{v} is absurd")))
    low: float = 0.0
    high: float = 1.0
    label: str = ""
    secret: bool = Field(False, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _high_follows_low(cls, data):
        if isinstance(data, dict) and "high" not in data and "low" in data:
            data = {**data, "high": data["low"]}
        return data

    @model_validator(mode="after")
    def _ordered(self):
        if self.low > self.high:
            raise ValueError(f"low {self.low} above high {self.high}")
        return self


def test_validators_settings_and_exclude():
    assert Checked(low=3).high == 3.0  # the before-validator fills a missing field
    with pytest.raises(ValidationError) as e:
        Checked(low=2, high=1)
    assert e.value.errors()[0]["msg"] == "Value error, low 2.0 above high 1.0" and e.value.errors()[0]["loc"] == ()
    with pytest.raises(ValidationError) as e:
        Checked(low=float("inf"))
    assert e.value.errors()[0]["type"] == "finite_number"
    with pytest.raises(ValidationError) as e:
        Checked(high=101.0)
    assert e.value.errors()[0]["loc"] == ("high",) and "101.0 is absurd" in e.value.errors()[0]["msg"]
    with pytest.raises(ValidationError, match="at most 5 characters"):
        Checked(label="abcdef")
    assert "secret" not in Checked(secret=True).model_dump() and Checked(secret=True).secret is True
    assert math.isnan(Outer(n=1, name="a", frac=None).model_copy(update={"frac": float("nan")}).frac)


def test_json_has_no_nan_and_defaults_are_not_shared():
    """A non-finite float is written null (pydantic's default; JSON has no NaN, and zplan's
    reader refuses it); an unhashable default is each record's own copy."""
    rec = Outer(n=1, name="a").model_copy(update={"frac": float("nan"), "triple": (1.0, float("inf"), 2.0)})
    assert json.loads(rec.model_dump_json()) == {**json.loads(Outer(n=1, name="a").model_dump_json()),
                                                 "frac": None, "triple": [1.0, None, 2.0]}
    a, b = Outer(n=1, name="a"), Outer(n=2, name="b")
    assert a.rates == {} and a.rates is not b.rates
