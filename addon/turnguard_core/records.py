"""``record``: a frozen, slotted dataclass that is cheap to make and to build.

turnguard's values (an identity, a request's facts, a decision, an attempt's end) are frozen
dataclasses, and a request makes about twenty of them. A frozen dataclass's own ``__init__``
sets each field with ``object.__setattr__`` (its class's ``__setattr__`` refuses): about
0.12 us a field on CPython 3.13, a tenth of a millisecond of turnguard's work per request
under load. ``record`` makes the same class (``dataclass(frozen=True, slots=True)``: the same
fields, signature, equality, hash, repr, ``replace`` and refusal to change after ``__init__``)
and gives it an ``__init__`` that sets each field through its slot's descriptor, without the
generic attribute lookup.

Making the class costs less too. ``dataclass`` compiles each class's methods from source:
about a millisecond a class here, and turnguard has about seventy records, so most of its
import (the start of every mitmdump that loads it, every script reload) went to them (165 ->
95 ms on CPython 3.13 without it). A plain class (``_plain_record``) is made here instead:
its ``__init__``, ``__eq__`` and ``__hash__`` are code compiled once for records of as many
fields, with the names replaced; the other methods are functions over the field names.

A class whose fields need more than plain defaults (``default_factory``, ``init=False``,
keyword-only fields, ``InitVar``, ``ClassVar``), that has a ``__post_init__``, a base class,
or methods of its own that dataclasses would make, is made by dataclasses (and keeps their
``__init__`` when its fields need more than plain defaults or it has a ``__post_init__``).
"""

from __future__ import annotations

import builtins
import dataclasses
import operator
import reprlib
import types
from typing import TypeVar

C = TypeVar("C", bound=type)


def record(cls: C) -> C:
    """``@dataclass(frozen=True, slots=True)`` with a faster ``__init__``, made without
    dataclasses' machinery when the class is plain (see the module)."""
    made = _plain_record(cls)
    if made is not None:
        return made
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    fields = dataclasses.fields(cls)
    plain = (
        all(f.init and not f.kw_only and f.default_factory is dataclasses.MISSING for f in fields)
        and len(fields) == len(cls.__dataclass_fields__)  # no InitVar (nor ClassVar)
        and not hasattr(cls, "__post_init__")
    )
    if plain and fields and all(_fits_the_code(f.name) for f in fields):
        init = _slot_init(cls, [(f.name, f.default) for f in fields])
        init.__annotations__ = cls.__init__.__annotations__
        init.__doc__ = cls.__init__.__doc__
        cls.__init__ = init
    return cls


# What ``dataclass(frozen=True, slots=True)`` sets on every class it makes, read once from one
# (a field's kind and the class's parameters): a plain record carries the same, so that
# ``dataclasses.fields``, ``replace``, ``asdict`` and a dataclass derived from it see a
# dataclass. None when this Python's dataclasses differ: every record is then made by them.
try:
    @dataclasses.dataclass(frozen=True, slots=True)
    class _Probe:
        x: int

    _FIELD_KIND = _Probe.__dataclass_fields__["x"]._field_type
    _PARAMS = _Probe.__dataclass_params__
except Exception:  # pragma: no cover - an interpreter whose dataclasses changed
    _FIELD_KIND = _PARAMS = None

# Names that, in a class body, make it more than a plain record: dataclasses decides then.
_NOT_PLAIN = frozenset({
    "__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__", "__getstate__",
    "__setstate__", "__match_args__", "__post_init__", "__slots__", "__replace__",
    "__dataclass_fields__", "__dataclass_params__", "__reduce__", "__reduce_ex__",
})


def _plain_record(cls: C) -> C | None:
    """The record of a plain class, made here; None when it is not plain.

    Plain: a class of its own (no base but ``object``, no metaclass) whose annotated names are
    its fields, each with no default or a hashable one given as a value (not ``field()``),
    none named ``__x`` nor a ``ClassVar``, ``InitVar`` or ``KW_ONLY``, and none of the methods
    dataclasses makes or reads in its body. The class made has what
    ``dataclass(frozen=True, slots=True)`` gives it: the same slots, signature, equality
    (the fields compared as a tuple, as on Python 3.12), hash, repr, refusal to change,
    pickling, ``__match_args__``, ``__replace__`` and dataclass fields."""
    own = cls.__dict__
    annotations = own.get("__annotations__")
    if annotations is None:  # no field; or annotations made lazily (Python 3.14)
        if "__annotate__" in own:
            return None
        annotations = {}
    if (_PARAMS is None or cls.__bases__ != (object,) or type(cls) is not type
            or not _NOT_PLAIN.isdisjoint(own)):
        return None
    names: list[str] = []
    defaults: list[object] = []
    for name, annotation in annotations.items():
        shown = annotation if isinstance(annotation, str) else repr(annotation)
        if ("ClassVar" in shown or "InitVar" in shown or "KW_ONLY" in shown
                or name.startswith("__")  # (a slot named so would be mangled)
                or not _fits_the_code(name)):
            return None
        default = own.get(name, dataclasses.MISSING)
        if default is dataclasses.MISSING:
            if defaults:
                return None  # a field without a default after one with: dataclass's error
        elif isinstance(default, dataclasses.Field) or type(default).__hash__ is None:
            return None  # field(...), or a mutable default: dataclass's error
        names.append(name)
        if default is not dataclasses.MISSING:
            defaults.append(default)
    namespace = {k: v for k, v in own.items()
                 if k not in annotations and k not in ("__dict__", "__weakref__")}
    namespace["__slots__"] = namespace["__match_args__"] = tuple(names)
    made = type(cls.__name__, cls.__bases__, namespace)
    made.__qualname__ = cls.__qualname__
    first_default = len(names) - len(defaults)
    fields = {}
    for i, name in enumerate(names):
        field = (dataclasses.field() if i < first_default
                 else dataclasses.field(default=defaults[i - first_default]))
        field.name, field.type, field.kw_only = name, annotations[name], False
        field._field_type = _FIELD_KIND
        fields[name] = field
    made.__dataclass_fields__ = fields
    made.__dataclass_params__ = _PARAMS
    for method in _methods(made, tuple(names)):
        method.__qualname__ = f"{made.__qualname__}.{method.__name__}"
        method.__module__ = made.__module__
        setattr(made, method.__name__, method)
    init = _slot_init(made, [(name, fields[name].default) for name in names])
    init.__annotations__ = {name: annotations[name] for name in names} | {"return": None}
    made.__init__ = init
    if made.__doc__ is None:
        made.__doc__ = f"{made.__name__}({', '.join(names)})"
    return made


def _methods(cls: type, names: tuple[str, ...]) -> tuple:
    """``cls``'s methods that ``dataclass(frozen=True, slots=True)`` would compile, for its
    fields ``names``: ``__eq__`` and ``__hash__`` from code compiled once for records of as
    many fields (``_code``), the others as functions over the names."""
    if len(names) > 1:
        values = operator.attrgetter(*names)
    elif names:
        one = operator.attrgetter(names[0])

        def values(self):
            return (one(self),)
    else:
        def values(self):
            return ()
    fixed = frozenset(names)
    attributes = {f"_f{i}": name for i, name in enumerate(names)}

    def compiled(kind: str):
        code = _code(kind, len(names))
        code = code.replace(co_names=tuple([attributes.get(n, n) for n in code.co_names]))
        return types.FunctionType(code, _BUILTINS, kind)

    @reprlib.recursive_repr()
    def __repr__(self):
        return (f"{self.__class__.__qualname__}("
                + ", ".join([f"{n}={v!r}" for n, v in zip(names, values(self))]) + ")")

    def __setattr__(self, name, value):
        if type(self) is cls or name in fixed:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self, name):
        if type(self) is cls or name in fixed:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    def __getstate__(self):
        return list(values(self))

    def __setstate__(self, state):
        for name, value in zip(names, state):
            object.__setattr__(self, name, value)

    def __replace__(self, /, **changes):
        return self.__class__(**(dict(zip(names, values(self))) | changes))

    return (__repr__, compiled("__eq__"), compiled("__hash__"), __setattr__, __delattr__,
            __getstate__, __setstate__, __replace__)


def _slot_init(cls: type, fields: list[tuple[str, object]]):
    """An ``__init__`` that sets each of ``fields`` (name, default or ``MISSING``) through its
    slot's descriptor: code compiled once for records of as many fields, its parameters
    renamed."""
    names = tuple(name for name, _ in fields)
    defaults = tuple(d for _, d in fields if d is not dataclasses.MISSING)  # the last ones
    setters = {f"_s{i}": _slot(cls, name).__set__ for i, name in enumerate(names)}
    code = _code("__init__", len(names)).replace(co_varnames=("self", *names))
    init = types.FunctionType(code, setters | _BUILTINS, "__init__", defaults or None)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    return init


def _fits_the_code(name: str) -> bool:
    """Whether a field's name can be a parameter of ``_code``'s ``__init__``: not ``self``,
    nor a name the code reads from its globals (``_s0``, ...)."""
    return name != "self" and not (name[:2] == "_s" and name[2:].isdigit())


_BUILTINS = {"__builtins__": builtins}
_CODE: dict[tuple[str, int], types.CodeType] = {}


def _code(kind: str, n: int) -> types.CodeType:
    """The code of a record's ``kind`` method for ``n`` fields, compiled once: ``__init__``
    sets ``self``'s slots from its parameters ``p0``, ``p1``, ... through the setters
    ``_s0``, ``_s1``, ... of its globals; ``__eq__`` and ``__hash__`` read the attributes
    ``_f0``, ``_f1``, ... (a record's methods are this code with its names replaced)."""
    code = _CODE.get((kind, n))
    if code is None:
        own = [f"self._f{i}" for i in range(n)]
        other = [f"other._f{i}" for i in range(n)]
        if kind == "__init__":
            params = "".join(f", p{i}" for i in range(n))
            body = "".join(f"\n    _s{i}(self, p{i})" for i in range(n)) or "\n    pass"
            source = f"def __init__(self{params}):{body}\n"
        elif kind == "__eq__":
            source = ("def __eq__(self, other):\n    if self is other:\n        return True\n"
                      "    if other.__class__ is self.__class__:\n"
                      f"        return ({', '.join(own)},) == ({', '.join(other)},)\n"
                      "    return NotImplemented\n").replace("(,)", "()")
        else:
            source = f"def __hash__(self):\n    return hash(({', '.join(own)},))\n".replace(
                "(,)", "()")
        namespace: dict[str, object] = {}
        exec(source, namespace)  # noqa: S102 - code made from a count, as dataclasses does
        code = _CODE[(kind, n)] = namespace[kind].__code__
    return code


def _slot(cls: type, name: str):
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise TypeError(f"{cls.__name__}.{name} has no slot")
