"""``record`` makes the class ``dataclass(frozen=True, slots=True)`` makes, with its own
``__init__`` (and, for a plain class, its own methods): the same signature, values, equality,
hash, repr, refusals, ``replace``, pickling and dataclass fields."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnguard_core import machine
from turnguard_core.records import record


@record
class Fast:
    a: int
    b: str
    c: object = None
    d: float = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class Usual:
    a: int
    b: str
    c: object = None
    d: float = 0.5


def _fields(obj) -> tuple:
    return tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))


@given(a=st.integers(), b=st.text(max_size=5), c=st.none() | st.integers(), d=st.floats(allow_nan=False),
       given_c=st.booleans(), given_d=st.booleans(), by_keyword=st.integers(0, 4))
def test_a_record_is_built_as_its_dataclass_is(a, b, c, d, given_c, given_d, by_keyword):
    values = {"a": a, "b": b} | ({"c": c} if given_c else {}) | ({"d": d} if given_d else {})
    names = list(values)
    args = [values[n] for n in names[:len(names) - min(by_keyword, len(names))]]
    kwargs = {n: values[n] for n in names[len(args):]}
    fast, usual = Fast(*args, **kwargs), Usual(*args, **kwargs)
    assert _fields(fast) == _fields(usual)
    assert repr(fast) == repr(usual).replace("Usual", "Fast")
    assert fast == Fast(*args, **kwargs) and hash(fast) == hash(Fast(*args, **kwargs))
    assert pickle.loads(pickle.dumps(fast)) == fast


@pytest.mark.parametrize("call", [
    lambda cls: cls(1),  # b missing
    lambda cls: cls(1, "x", None, 0.1, "one too many"),
    lambda cls: cls(1, "x", e=2),
    lambda cls: cls(1, "x", a=1),
])
def test_a_record_refuses_the_arguments_its_dataclass_refuses(call):
    with pytest.raises(TypeError):
        call(Usual)
    with pytest.raises(TypeError):
        call(Fast)


def test_a_record_cannot_change_and_replace_makes_a_new_one():
    fast = Fast(1, "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.a = 2
    with pytest.raises((AttributeError, TypeError)):
        fast.e = 1  # slots: no other attribute
    assert dataclasses.replace(fast, d=2.0) == Fast(1, "x", None, 2.0) and fast.d == 0.5
    assert not hasattr(fast, "__dict__")


def test_fields_beyond_plain_defaults_keep_the_dataclass_init():
    @record
    class WithFactory:
        a: int
        b: list = dataclasses.field(default_factory=list)

    @record
    class Checked:
        a: int

        def __post_init__(self):
            if self.a < 0:
                raise ValueError("negative")

    assert WithFactory(1).b == [] and WithFactory(1).b is not WithFactory(1).b
    with pytest.raises(ValueError):
        Checked(-1)
    assert Checked(1).a == 1
    emit = machine.Emit("event")  # the addon's one record with a default factory
    assert emit.fields == {} and emit.fields is not machine.Emit("event").fields


@record
class NoField:
    """A record with no field."""


@dataclasses.dataclass(frozen=True, slots=True)
class UsualNoField:
    """A dataclass with no field."""


@record
class OneField:
    a: object


def test_a_plain_record_carries_what_its_dataclass_carries():
    fast, usual = Fast(1, "x"), Usual(1, "x")
    assert type(fast).__dict__.get("__dataclass_fields__") is not None  # made here, not by dataclass
    assert [(f.name, f.type, f.default, f.init, f.kw_only, f.compare, f.hash, f.repr)
            for f in dataclasses.fields(fast)] == [
        (f.name, f.type, f.default, f.init, f.kw_only, f.compare, f.hash, f.repr)
        for f in dataclasses.fields(usual)]
    assert dataclasses.is_dataclass(Fast) and dataclasses.is_dataclass(fast)
    assert repr(Fast.__dataclass_params__) == repr(Usual.__dataclass_params__)
    assert Fast.__slots__ == Usual.__slots__ and Fast.__match_args__ == Usual.__match_args__
    assert str(inspect.signature(Fast)) == str(inspect.signature(Usual))
    assert dataclasses.asdict(fast) == dataclasses.asdict(usual)
    assert copy.copy(fast) == fast and copy.deepcopy(fast) == fast
    if sys.version_info >= (3, 13):
        assert copy.replace(fast, a=2) == Fast(2, "x")
        with pytest.raises(TypeError):
            copy.replace(fast, e=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        del fast.a
    match fast:
        case Fast(a, b, c, d):
            assert (a, b, c, d) == (1, "x", None, 0.5)
    assert fast != usual and fast != (1, "x", None, 0.5)
    assert Fast(1, "x", [1]) == Fast(1, "x", [1])
    with pytest.raises(TypeError):
        hash(Fast(1, "x", [1]))  # an unhashable field makes the record unhashable, as there
    nested = Fast(1, "x", Fast(2, "y"))
    assert repr(nested) == "Fast(a=1, b='x', c=Fast(a=2, b='y', c=None, d=0.5), d=0.5)"


def test_records_of_no_field_and_of_one_are_their_dataclasses():
    assert repr(NoField()) == "NoField()" and NoField() == NoField()
    assert hash(NoField()) == hash(UsualNoField()) and dataclasses.fields(NoField()) == ()
    assert pickle.loads(pickle.dumps(NoField())) == NoField()
    with pytest.raises(TypeError):
        NoField(1)
    one = OneField(3)
    assert repr(one) == "OneField(a=3)" and hash(one) == hash((3,))
    assert pickle.loads(pickle.dumps(one)) == one and dataclasses.replace(one, a=4) == OneField(4)


def test_a_dataclass_may_derive_from_a_record():
    @dataclasses.dataclass(frozen=True)
    class Derived(Fast):
        e: int = 0

    derived = Derived(1, "x", e=3)
    assert (derived.a, derived.e) == (1, 3) and [f.name for f in dataclasses.fields(derived)] == [
        "a", "b", "c", "d", "e"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        derived.e = 4


@pytest.mark.parametrize("body", [
    "a: int = 1\n    b: str",  # a field without a default after one with
    "a: list = []",  # a mutable default
])
def test_a_record_refuses_the_classes_its_dataclass_refuses(body):
    for decorator in (record, dataclasses.dataclass(frozen=True, slots=True)):
        namespace = {"decorator": decorator}
        with pytest.raises((TypeError, ValueError)) as refused:
            exec(f"@decorator\nclass Bad:\n    {body}\n", namespace)  # noqa: S102
        assert "Bad" not in namespace, refused


def test_fields_named_as_the_codes_own_names_are_made_by_dataclasses():
    @record
    class Odd:
        self: int
        _s0: int = 2

    odd = Odd(1)
    assert (odd.self, odd._s0) == (1, 2) and Odd(self=3, _s0=4)._s0 == 4
