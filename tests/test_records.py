"""``record`` makes the class ``dataclass(frozen=True, slots=True)`` makes, with its own
``__init__``: the same signature, values, equality, hash, repr, refusals and ``replace``."""

from __future__ import annotations

import dataclasses
import pickle

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
