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
run. The pure-Python `pickle._Unpickler` is the base: unlike the C one, its opcodes can be
replaced one by one (`dispatch`), so REDUCE, BUILD and NEWOBJ never reach a method of ours
that we did not choose.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cognet.core.errors import InputError, one_line

MAX_BYTES = 1 << 30  # the MIMIC-III records are 1.5 MB; a pickle builds at most its own size
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


class Refused(Exception):
    """A pickle asked for something these files never need; `load` adds the file's name."""


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
    if name == "type":
        return TYPE
    if name == "object":
        return OBJECT
    raise Refused(f"dill._dill._load_type({name!r}): only 'type' and 'object' are allowed")


def _create_type(metaclass, name, bases, namespace):
    if metaclass is not TYPE or name != "Voc" or bases != (OBJECT,):
        raise Refused(
            f"dill._dill._create_type: only class Voc(object) is allowed, got "
            f"{describe(metaclass)} {name!r} with bases ({', '.join(map(describe, bases))})"
        )
    if not isinstance(namespace, dict):
        raise Refused(f"dill._dill._create_type: namespace is a {describe(namespace)}")
    for key, value in namespace.items():
        if key not in VOC_CLASS_KEYS:
            raise Refused(f"dill._dill._create_type: class attribute {key!r} is not allowed")
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
        raise Refused(f"dill._dill._create_function {name!r}: closures are not allowed")
    extras = [*(defaults or ())]
    extras += [v for d in rest if isinstance(d, dict) for v in d.values()]
    plain = all(d is None or isinstance(d, dict) for d in rest)
    if not plain or not all(_plain_constant(v) for v in extras):
        raise Refused(f"dill._dill._create_function {name!r}: defaults are not literals")
    return Placeholder(f"function {name} (a placeholder, never called)")


# -- numpy, directly or through dill's array path ---------------------------------------------


def _import_module(name, *_safe):
    if name in NUMPY_ARRAY_MODULES:
        return Placeholder(f"module {name}")
    raise Refused(f"dill._dill._import_module({name!r}): only numpy's array modules are allowed")


def _get_attr(module, name):
    if (
        isinstance(module, Placeholder)
        and module.what.startswith("module ")
        and (name == "_reconstruct")
    ):
        return RECONSTRUCT
    raise Refused(f"dill._dill._get_attr({describe(module)}, {name!r}): only _reconstruct")


def _reconstruct(subtype, shape, typecode):
    if subtype is not NDARRAY or shape != (0,) or typecode != b"b":
        raise Refused(
            f"numpy _reconstruct({describe(subtype)}, {shape!r}, {typecode!r}): only an "
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
        raise Refused(f"numpy.dtype({name!r}): only bool, integer and float dtypes are allowed")
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
        raise Refused(f"numpy.dtype state {state!r:.80}: not a plain numeric dtype's")
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
        raise Refused(f"numpy array shape {shape!r:.80}: not a shape")
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
        raise Refused(f"_codecs.encode(..., {encoding!r}): only latin1 text to bytes")
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
}
GLOBALS.update({(m, name): f for m in DILL_MODULES for name, f in DILL.items()})
GLOBALS.update({(m, "_reconstruct"): RECONSTRUCT for m in NUMPY_ARRAY_MODULES})
GLOBALS.update({(m, "scalar"): SCALAR for m in NUMPY_ARRAY_MODULES})


# -- the unpickler ----------------------------------------------------------------------------


def _refuse(what: str) -> Callable:
    def refuse(self) -> None:
        raise Refused(f"{what} is not allowed")

    return refuse


class BenchmarkUnpickler(pickle._Unpickler):
    """pickle's (pure-Python) unpickler with every global and every call replaced by ours."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        found = GLOBALS.get((module, name))
        if found is None:
            raise Refused(f"global {module}.{name} is not one of the names these files use")
        return found

    def persistent_load(self, pid):
        raise Refused("a persistent id is not allowed")

    def load_reduce(self) -> None:
        stack = self.stack
        args, function = stack.pop(), stack[-1]
        if not isinstance(function, _Reconstructor):
            raise Refused(f"REDUCE would call {describe(function)}")
        if not isinstance(args, tuple):
            raise Refused(f"REDUCE of {function.name} with {describe(args)} arguments")
        stack[-1] = function(*args)

    def load_build(self) -> None:
        stack = self.stack
        state, target = stack.pop(), stack[-1]
        if isinstance(target, Voc):
            if not (isinstance(state, dict) and set(state) <= VOC_STATE_KEYS):
                keys = sorted(map(str, state)) if isinstance(state, dict) else describe(state)
                raise Refused(f"BUILD of a Voc with {keys}: only idx2word and word2idx")
            for key, value in state.items():
                setattr(target, key, value)
        elif isinstance(target, _Dtype):
            _build_dtype(target, state)
        elif isinstance(target, _ArrayBuilder):
            _build_array(target, state)
            stack[-1] = target.array
        else:
            raise Refused(f"BUILD on {describe(target)}")

    def load_newobj(self) -> None:
        args, cls = self.stack.pop(), self.stack.pop()
        self.append(_new(cls, args, {}))

    def load_newobj_ex(self) -> None:
        kwargs, args, cls = self.stack.pop(), self.stack.pop(), self.stack.pop()
        self.append(_new(cls, args, kwargs))

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.OBJ[0]] = _refuse("OBJ (a class call)")
    dispatch[pickle.INST[0]] = _refuse("INST (a class call)")
    for _ext in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_ext[0]] = _refuse("an extension code")
    del _ext


def _new(cls, args, kwargs) -> Voc:
    if not (isinstance(cls, Placeholder) and cls.what == "class Voc") or args or kwargs:
        raise Refused(f"NEWOBJ of {describe(cls)}: only a Voc, with no arguments")
    return Voc()


def load(path: str | os.PathLike) -> object:
    """The object a benchmark pickle describes, built only by the stand-ins above.

    Raises `InputError` (`PATH: refused: ...` or `PATH: not a readable pickle (...)`) for a
    missing, oversized, malformed or refused file; nothing in the file runs either way."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    if path.stat().st_size > MAX_BYTES:
        raise InputError(f"{path}: larger than {MAX_BYTES >> 20} MiB; not a benchmark file")
    data = path.read_bytes()
    try:
        return BenchmarkUnpickler(io.BytesIO(data)).load()
    except Refused as exc:
        raise InputError(
            f"{path}: refused: {one_line(exc)} (nothing in the file was run)"
        ) from None
    except Exception as exc:  # a truncated or malformed stream: pickle raises many kinds
        raise InputError(f"{path}: not a readable pickle ({one_line(exc)})") from None
