"""dill's class machinery, as the benchmark files use it, rebuilt as inert placeholders.

voc_final.pkl holds a `Voc` class pickled by value: dill's `_create_type` over a namespace
of functions, each `_create_function` of a `_create_code` of its bytecode; dill 0.4 then
sets each function's `__qualname__` and `__annotations__` by BUILD and the class's
`__qualname__` by `builtins.setattr`. Here each of these checks its arguments (literals
only; builtin types only as annotations) and gives a placeholder that is never called;
nothing is set on anything.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

from cognet.data.pickle_bounds import Refused, shown

VOC_CLASS_KEYS = frozenset(
    ["__module__", "__qualname__", "__doc__", "__slotnames__", "__init__", "add_sentence"]
)
# what dill 0.4 sets on a function by BUILD; plain attributes, the function is never called
FUNCTION_STATE_KEYS = frozenset(
    ["__qualname__", "__name__", "__module__", "__doc__", "__annotations__", "__kwdefaults__"]
    + ["__defaults__"]
)
ANNOTATION_TYPES = frozenset(
    ["int", "float", "complex", "str", "bytes", "bool", "list", "dict", "tuple", "set"]
    + ["frozenset", "NoneType"]
)


class Placeholder:
    """An inert stand-in (a class, function, code object, module or namespace of the pickle):
    it has no behaviour, and the unpickler refuses to call it or set anything on it."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"<placeholder {self.what}>"


class Reconstructor:
    """A callable stand-in for one allowed global: the only thing REDUCE may call."""

    __slots__ = ("name", "function")

    def __init__(self, name: str, function: Callable):
        self.name, self.function = name, function

    def __call__(self, *args):
        return self.function(*args)


def describe(obj: object) -> str:
    """How a refusal names an object of the pickle."""
    if isinstance(obj, Placeholder):
        return obj.what
    if isinstance(obj, Reconstructor):
        return obj.name
    return type(obj).__name__


TYPE, OBJECT = Placeholder("builtins.type"), Placeholder("builtins.object")
MAIN = Placeholder("the __main__ namespace")
CODE = Placeholder("a code object")


def _load_type(name):
    """`type` and `object` for the Voc class; builtin types as placeholders, which only an
    annotation may hold."""
    if name == "type":
        return TYPE
    if name == "object":
        return OBJECT
    if name in ANNOTATION_TYPES:
        return Placeholder(f"builtins.{name}")
    raise Refused(
        f"dill._dill._load_type({shown(name)}): only 'type', 'object' and plain builtin types"
    )


def _create_type(metaclass, name, bases, namespace):
    if metaclass is not TYPE or name != "Voc" or bases != (OBJECT,):
        parents = describe(bases)
        if isinstance(bases, tuple):
            parents = ", ".join(map(describe, bases[:3]))
        raise Refused(
            f"dill._dill._create_type: only class Voc(object) is allowed, got "
            f"{describe(metaclass)} {shown(name)} with bases ({parents})"
        )
    if not isinstance(namespace, dict):
        raise Refused(f"dill._dill._create_type: namespace is a {describe(namespace)}")
    for key, value in namespace.items():
        if key not in VOC_CLASS_KEYS:
            raise Refused(f"dill._dill._create_type: class attribute {shown(key)} is not allowed")
        if key in ("__init__", "add_sentence") and not isinstance(value, Placeholder):
            raise Refused(f"dill._dill._create_type: {key} is a {describe(value)}")
    return Placeholder("class Voc")


def _plain_constant(value, depth: int = 0) -> bool:
    """Whether a code object's argument holds only literals (and nested code placeholders)."""
    if value is None or value is CODE or isinstance(value, (int, float, complex, str, bytes)):
        return True
    if isinstance(value, (tuple, frozenset)) and depth < 16:
        return all(_plain_constant(item, depth + 1) for item in value)
    return False


def _create_code(*args):
    if len(args) > 24 or not all(_plain_constant(arg) for arg in args):
        bad = next((describe(a) for a in args if not _plain_constant(a)), f"{len(args)} args")
        raise Refused(f"dill._dill._create_code: argument {bad} is not a literal")
    return CODE


def _create_function(code, namespace, name=None, defaults=None, closure=None, *rest):
    """dill's function: (code, globals, name, defaults, closure[, __dict__[, kwdefaults]])."""
    if code is not CODE or not (namespace is MAIN or isinstance(namespace, dict)):
        raise Refused(
            f"dill._dill._create_function: needs a code placeholder and the __main__ "
            f"namespace, got {describe(code)} and {describe(namespace)}"
        )
    if closure is not None or not isinstance(name, str) or len(rest) > 2:
        raise Refused(f"dill._dill._create_function {shown(name)}: closures are not allowed")
    plain = all(d is None or isinstance(d, dict) for d in rest)
    if not plain or not isinstance(defaults, (tuple, type(None))):
        raise Refused(f"dill._dill._create_function {shown(name)}: defaults are not literals")
    # walked, not copied: what the reader charges a call holds no list of its arguments
    extras = chain(defaults or (), *(d.values() for d in rest if d is not None))
    if not all(_plain_constant(v) for v in extras):
        raise Refused(f"dill._dill._create_function {shown(name)}: defaults are not literals")
    return Placeholder(f"function {name} (a placeholder, never called)")


def _literal_attribute(key: str, value) -> bool:
    if key in ("__qualname__", "__name__", "__module__"):
        return isinstance(value, str)
    if key == "__doc__":
        return value is None or isinstance(value, str)
    if key == "__defaults__":
        return value is None or (isinstance(value, tuple) and _plain_constant(value))
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return key == "__kwdefaults__" and value is None
    if key == "__kwdefaults__":
        return all(_plain_constant(v) for v in value.values())
    return all(  # __annotations__: builtin types (placeholders), None or text
        v is None
        or isinstance(v, str)
        or (
            isinstance(v, Placeholder)
            and v.what.startswith("builtins.")
            and v.what[9:] in ANNOTATION_TYPES
        )
        for v in value.values()
    )


def build_function(function: Placeholder, state) -> None:
    """dill 0.4's BUILD on a function: (__dict__, slot state), each {attribute: value}. Only
    plain attributes with literal values (annotations naming builtin types) are accepted, and
    nothing is set: the placeholder is never called."""
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    for part in parts:
        if part is None:
            continue
        if not isinstance(part, dict):
            raise Refused(f"BUILD on {function.what} with a {describe(part)}")
        for key, value in part.items():
            if key not in FUNCTION_STATE_KEYS or not _literal_attribute(key, value):
                raise Refused(
                    f"BUILD on {function.what} setting {shown(key)} to {describe(value)}: only "
                    "plain attributes with literal values"
                )


def _setattr(target, name, value):
    """`builtins.setattr`, as dill 0.4 names the class it made: only `__qualname__`, as text,
    on the Voc class placeholder; nothing is set."""
    voc = isinstance(target, Placeholder) and target.what == "class Voc"
    if not voc or name != "__qualname__" or not isinstance(value, str):
        raise Refused(
            f"builtins.setattr({describe(target)}, {shown(name)}, ...): only the Voc class's "
            "__qualname__"
        )


CLASS_MACHINERY = {  # dill._dill's names
    f.__name__: Reconstructor(f"dill._dill.{f.__name__}", f)
    for f in (_load_type, _create_type, _create_code, _create_function)
}
SETATTR = Reconstructor("builtins.setattr", _setattr)
