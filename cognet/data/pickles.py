"""A restricted unpickler for the field's benchmark files: nothing in a pickle ever runs.

`records_final.pkl`, `voc_final.pkl` and `ddi_A_final.pkl` (GAMENet, SafeDrug, COGNet, ...)
are pickles, two of them written by dill, and dill's reconstructors are themselves a way to
run code: `_create_code` and `_create_function` build any bytecode, `_import_module` and
`_get_attr` reach any module, `_create_array` calls whatever function it is handed. So
`load` never calls pickle's or dill's own loaders (dill is not even imported). Each global
these files use maps to a stand-in of our own that checks its arguments:

- dill's class machinery (`_create_type`, `_load_type`, `_create_code`, `_create_function`,
  `__main__`) builds inert placeholders: a `Voc` class placeholder whose instances are our
  `Voc` (two dicts), functions and code objects that are never called;
- dill's array path (`_import_module`, `_get_attr`, `_create_array`) reaches only numpy's
  `_reconstruct`, itself a stand-in; numpy arrays, dtypes (bool, int, uint and float only)
  and scalars are rebuilt by our code from their raw bytes (`np.frombuffer`, copied).

Every other global, every other use of these names (a REDUCE of a placeholder, a BUILD on
anything but a Voc, a dtype or an array, NEWOBJ of anything but the Voc placeholder, OBJ,
INST, persistent ids, extension codes) is refused with `InputError` naming it, before it can
run. The stream is parsed by `cognet.data.pickle_reader`, our own reader, which also bounds
what a file can build (lengths, depth, elements through shared references, keys, the end):
REDUCE, BUILD and NEWOBJ reach only the methods of `BenchmarkUnpickler` below.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cognet.core.errors import InputError, one_line
from cognet.data.pickle_reader import BoundedReader, Malformed, Refused, printable, shown

MAX_BYTES = 1 << 30  # the MIMIC-III records are 1.5 MB; pickle_reader bounds what a file builds
MAX_DIMS = 32

DILL_MODULES = ("dill._dill", "dill.dill")  # dill >= 0.3, and older
NUMPY_ARRAY_MODULES = (
    "numpy.core.multiarray",
    "numpy._core.multiarray",  # numpy 2
    "numpy.core._multiarray_umath",
    "numpy._core._multiarray_umath",
)
NUMERIC_DTYPES = frozenset(
    ["b1", "f2", "f4", "f8"] + [f"{k}{n}" for k in "iu" for n in (1, 2, 4, 8)]
)
VOC_CLASS_KEYS = frozenset(
    ["__module__", "__qualname__", "__doc__", "__slotnames__", "__init__", "add_sentence"]
)
VOC_STATE_KEYS = frozenset(["idx2word", "word2idx"])
# what dill 0.4 sets on a function by BUILD; plain attributes, the function is never called
FUNCTION_STATE_KEYS = frozenset(
    ["__qualname__", "__name__", "__module__", "__doc__", "__annotations__", "__kwdefaults__"]
    + ["__defaults__"]
)
ANNOTATION_TYPES = frozenset(
    ["int", "float", "complex", "str", "bytes", "bool", "list", "dict", "tuple", "set"]
    + ["frozenset", "NoneType"]
)


# -- what the pickles build -------------------------------------------------------------------


class Placeholder:
    """An inert stand-in (a class, function, code object, module or namespace of the pickle):
    it has no behaviour, and the unpickler refuses to call it or set anything on it."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"<placeholder {self.what}>"


class Voc:
    """A vocabulary of the benchmark files: `idx2word` {id: word}, `word2idx` {word: id}."""

    __slots__ = ("idx2word", "word2idx")

    def __init__(self) -> None:
        self.idx2word = None
        self.word2idx = None


class _Dtype:
    """A numeric numpy dtype, rebuilt from its name (and byte order, by BUILD)."""

    __slots__ = ("dtype", "built")

    def __init__(self, dtype: np.dtype):
        self.dtype, self.built = dtype, False


class _ArrayBuilder:
    """The empty array numpy's `_reconstruct` makes, filled by its BUILD state."""

    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array = None


class _Reconstructor:
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
    if isinstance(obj, _Reconstructor):
        return obj.name
    return type(obj).__name__


TYPE, OBJECT = Placeholder("builtins.type"), Placeholder("builtins.object")
NDARRAY = Placeholder("numpy.ndarray")
MAIN = Placeholder("the __main__ namespace")
CODE = Placeholder("a code object")


# -- dill's class machinery -------------------------------------------------------------------


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
        raise Refused(
            f"dill._dill._create_type: only class Voc(object) is allowed, got "
            f"{describe(metaclass)} {shown(name)} with bases ({', '.join(map(describe, bases))})"
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
    extras = [*(defaults or ())]
    extras += [v for d in rest if isinstance(d, dict) for v in d.values()]
    plain = all(d is None or isinstance(d, dict) for d in rest)
    if not plain or not all(_plain_constant(v) for v in extras):
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


def _build_function(function: Placeholder, state) -> None:
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


# -- numpy, directly or through dill's array path ---------------------------------------------


def _import_module(name, *_safe):
    if name in NUMPY_ARRAY_MODULES:
        return Placeholder(f"module {name}")
    raise Refused(
        f"dill._dill._import_module({shown(name)}): only numpy's array modules are allowed"
    )


def _get_attr(module, name):
    if (
        isinstance(module, Placeholder)
        and module.what.startswith("module ")
        and (name == "_reconstruct")
    ):
        return RECONSTRUCT
    raise Refused(f"dill._dill._get_attr({describe(module)}, {shown(name)}): only _reconstruct")


def _reconstruct(subtype, shape, typecode):
    if subtype is not NDARRAY or shape != (0,) or typecode != b"b":
        raise Refused(
            f"numpy _reconstruct({describe(subtype)}, {shown(shape)}, {shown(typecode)}): only an "
            "empty numpy.ndarray"
        )
    return _ArrayBuilder()


def _create_array(function, args, state, npdict=None):
    if function is not RECONSTRUCT or not isinstance(args, tuple):
        raise Refused(
            f"dill._dill._create_array: the function must be numpy's _reconstruct, got "
            f"{describe(function)}"
        )
    if npdict:
        raise Refused("dill._dill._create_array: array attributes are not allowed")
    builder = RECONSTRUCT(*args)
    _build_array(builder, state)
    return builder.array


def _dtype(name, align=False, copy=False):
    if name not in NUMERIC_DTYPES or align is not False or not isinstance(copy, bool):
        raise Refused(
            f"numpy.dtype({shown(name)}): only bool, integer and float dtypes are allowed"
        )
    return _Dtype(np.dtype(name))


def _build_dtype(dtype: _Dtype, state) -> None:
    """numpy's dtype state: (version, byte order, subarray, names, fields, itemsize,
    alignment, flags[, metadata]); only a plain numeric dtype's."""
    plain = (
        isinstance(state, tuple)
        and len(state) in (8, 9)
        and state[0] in (3, 4)
        and state[1] in ("<", ">", "|", "=")
        and state[2:5] == (None, None, None)
        and state[5:7] == (-1, -1)
        and isinstance(state[7], int)
        and (len(state) == 8 or state[8] is None)
    )
    if not plain or dtype.built:
        raise Refused(f"numpy.dtype state {shown(state)}: not a plain numeric dtype's")
    if state[1] in "<>" and dtype.dtype.itemsize > 1:
        dtype.dtype = dtype.dtype.newbyteorder(state[1])
    dtype.built = True


def _build_array(builder: _ArrayBuilder, state) -> None:
    """numpy's array state: ([version,] shape, dtype, fortran order, raw bytes)."""
    if isinstance(state, tuple) and len(state) == 5 and state[0] == 1:
        state = state[1:]
    if not isinstance(state, tuple) or len(state) != 4 or builder.array is not None:
        raise Refused(f"numpy array state {describe(state)}: not an array's")
    shape, dtype, fortran, raw = state
    good_shape = isinstance(shape, tuple) and len(shape) <= MAX_DIMS
    if not good_shape or not all(type(n) is int and n >= 0 for n in shape):
        raise Refused(f"numpy array shape {shown(shape)}: not a shape")
    if not isinstance(dtype, _Dtype) or not isinstance(raw, (bytes, bytearray)):
        raise Refused(
            f"numpy array of {describe(dtype)} from {describe(raw)}: only numeric dtypes "
            "from raw bytes"
        )
    if type(fortran) is not bool or math.prod(shape) * dtype.dtype.itemsize != len(raw):
        raise Refused(f"numpy array of shape {shape}: {len(raw)} bytes do not fit")
    flat = np.frombuffer(bytes(raw), dtype=dtype.dtype)
    builder.array = flat.reshape(shape, order="F" if fortran else "C").copy()


def _scalar(dtype, raw):
    if not isinstance(dtype, _Dtype) or not isinstance(raw, bytes):
        raise Refused(f"numpy scalar of {describe(dtype)}: only numeric dtypes from raw bytes")
    if len(raw) != dtype.dtype.itemsize:
        raise Refused(f"numpy scalar {dtype.dtype}: {len(raw)} bytes do not fit")
    return np.frombuffer(raw, dtype=dtype.dtype)[0]


def _encode(text, encoding="utf-8"):
    """`_codecs.encode`: how protocol 2 writes bytes (a numpy scalar's, an array's)."""
    if not isinstance(text, str) or encoding != "latin1":
        raise Refused(f"_codecs.encode(..., {shown(encoding)}): only latin1 text to bytes")
    return text.encode("latin1")


RECONSTRUCT = _Reconstructor("numpy _reconstruct", _reconstruct)
SCALAR = _Reconstructor("numpy scalar", _scalar)
DILL = {
    f.__name__: _Reconstructor(f"dill._dill.{f.__name__}", f)
    for f in (
        _load_type,
        _create_type,
        _create_code,
        _create_function,
        _import_module,
        _get_attr,
        _create_array,
    )
}
GLOBALS = {
    ("numpy", "ndarray"): NDARRAY,
    ("numpy", "dtype"): _Reconstructor("numpy.dtype", _dtype),
    ("__builtin__", "__main__"): MAIN,  # how dill names a function's globals: __main__'s
    ("builtins", "__main__"): MAIN,
    ("__main__", "Voc"): Placeholder("class Voc"),  # a Voc pickled by reference
    ("_codecs", "encode"): _Reconstructor("_codecs.encode", _encode),
    ("builtins", "setattr"): _Reconstructor("builtins.setattr", _setattr),
}
GLOBALS.update({(m, name): f for m in DILL_MODULES for name, f in DILL.items()})
GLOBALS.update({(m, "_reconstruct"): RECONSTRUCT for m in NUMPY_ARRAY_MODULES})
GLOBALS.update({(m, "scalar"): SCALAR for m in NUMPY_ARRAY_MODULES})


# -- the unpickler ----------------------------------------------------------------------------


class BenchmarkUnpickler(BoundedReader):
    """The bounded reader (`cognet.data.pickle_reader`) with the globals and calls above."""

    def find_class(self, module: str, name: str) -> object:
        found = GLOBALS.get((module, name))
        if found is None:
            what = printable(f"{module}.{name}")
            raise Refused(f"global {what} is not one of the names these files use")
        return found

    def reduce(self, function: object, args: tuple) -> object:
        if not isinstance(function, _Reconstructor):
            raise Refused(f"REDUCE would call {describe(function)}")
        return function(*args)

    def build(self, target: object, state: object) -> object:
        if isinstance(target, Voc):
            if not (isinstance(state, dict) and set(state) <= VOC_STATE_KEYS):
                keys = sorted(map(shown, state)) if isinstance(state, dict) else describe(state)
                raise Refused(f"BUILD of a Voc with {keys}: only idx2word and word2idx")
            for key, value in state.items():
                setattr(target, key, value)
            return target
        if isinstance(target, _Dtype):
            _build_dtype(target, state)
            return target
        if isinstance(target, _ArrayBuilder):
            _build_array(target, state)
            return target.array
        if isinstance(target, Placeholder) and target.what.startswith("function "):
            _build_function(target, state)
            return target
        raise Refused(f"BUILD on {describe(target)}")

    def new(self, cls: object, args: tuple, kwargs: dict) -> Voc:
        if not (isinstance(cls, Placeholder) and cls.what == "class Voc") or args or kwargs:
            raise Refused(f"NEWOBJ of {describe(cls)}: only a Voc, with no arguments")
        return Voc()


def load(path: str | os.PathLike) -> object:
    """The object a benchmark pickle describes, built only by the stand-ins above.

    Raises `InputError` (`PATH: refused: ...` or `PATH: not a readable pickle (...)`) for a
    missing, oversized, malformed or refused file; nothing in the file runs either way, and
    the message never holds the file's bytes."""
    path = Path(path)
    name = printable(str(path), 400)
    if not path.is_file():
        raise InputError(f"{name}: file not found")
    if path.stat().st_size > MAX_BYTES:
        raise InputError(f"{name}: larger than {MAX_BYTES >> 20} MiB; not a benchmark file")
    reader = BenchmarkUnpickler(path.read_bytes())
    try:
        return reader.load()
    except Refused as exc:
        where = f"opcode at byte {reader.opcode_at:,}"
        raise InputError(
            f"{name}: refused: {one_line(exc)} ({where}; nothing in the file was run)"
        ) from None
    except Malformed as exc:
        raise InputError(
            f"{name}: not a readable pickle ({exc} at byte {reader.opcode_at:,})"
        ) from None
    except Exception as exc:  # a stand-in given the wrong arguments: only the kind is shown
        raise InputError(
            f"{name}: not a readable pickle ({type(exc).__name__} at byte {reader.opcode_at:,})"
        ) from None
