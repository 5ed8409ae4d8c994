"""A restricted unpickler for the field's benchmark files: nothing in a pickle ever runs.

`records_final.pkl`, `voc_final.pkl` and `ddi_A_final.pkl` (GAMENet, SafeDrug, COGNet, ...)
are pickles, two of them written by dill, and dill's reconstructors are themselves a way to
run code: `_create_code` and `_create_function` build any bytecode, `_import_module` and
`_get_attr` reach any module, `_create_array` calls whatever function it is handed. So
`load` never calls pickle's or dill's own loaders (dill is not even imported). Each global
these files use maps to a stand-in of our own that checks its arguments:

- dill's class machinery (`_create_type`, `_load_type`, `_create_code`, `_create_function`,
  `__main__`, and dill 0.4's BUILD on a function and `setattr` of the class's name; see
  `cognet.data.pickle_dill`) builds inert placeholders: a `Voc` class placeholder whose
  instances are our `Voc` (two dicts), functions and code objects that are never called;
- dill's array path (`_import_module`, `_get_attr`, `_create_array`) reaches only numpy's
  `_reconstruct`, itself a stand-in; numpy arrays, dtypes (bool, int, uint and float only)
  and scalars are rebuilt by our code from their raw bytes (`np.frombuffer`, copied).

Every other global, every other use of these names (a REDUCE of a placeholder, a BUILD on
anything but a Voc, a dtype or an array, NEWOBJ of anything but the Voc placeholder, OBJ,
INST, persistent ids, extension codes) is refused with `InputError` naming it, before it can
run. The stream is parsed by `cognet.data.pickle_reader`, our own reader, which also bounds
what a file can build (`cognet.data.pickle_bounds`: memory, lengths, depth, elements through
shared references, keys, the end); REDUCE, BUILD and NEWOBJ reach only the methods of
`BenchmarkUnpickler` below.
"""

from __future__ import annotations

import math
import os
from itertools import islice
from pathlib import Path

import numpy as np

from cognet.core.errors import InputError, one_line
from cognet.data.pickle_bounds import Malformed, Refused, printable, shown
from cognet.data.pickle_dill import (
    CLASS_MACHINERY,
    MAIN,
    SETATTR,
    Placeholder,
    Reconstructor,
    build_function,
    describe,
)
from cognet.data.pickle_reader import BoundedReader

MAX_BYTES = 1 << 30  # the MIMIC-III records are 1.5 MB; pickle_bounds bounds what a file builds
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
VOC_STATE_KEYS = frozenset(["idx2word", "word2idx"])


# -- what the pickles build -------------------------------------------------------------------


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


NDARRAY = Placeholder("numpy.ndarray")


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


RECONSTRUCT = Reconstructor("numpy _reconstruct", _reconstruct)
SCALAR = Reconstructor("numpy scalar", _scalar)
DILL = {
    f.__name__: Reconstructor(f"dill._dill.{f.__name__}", f)
    for f in (_import_module, _get_attr, _create_array)
}
DILL.update(CLASS_MACHINERY)
GLOBALS = {
    ("numpy", "ndarray"): NDARRAY,
    ("numpy", "dtype"): Reconstructor("numpy.dtype", _dtype),
    ("__builtin__", "__main__"): MAIN,  # how dill names a function's globals: __main__'s
    ("builtins", "__main__"): MAIN,
    ("__main__", "Voc"): Placeholder("class Voc"),  # a Voc pickled by reference
    ("_codecs", "encode"): Reconstructor("_codecs.encode", _encode),
    ("builtins", "setattr"): SETATTR,
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
        if not isinstance(function, Reconstructor):
            raise Refused(f"REDUCE would call {describe(function)}")
        return function(*args)

    def build(self, target: object, state: object) -> object:
        if isinstance(target, Voc):
            if not (isinstance(state, dict) and state.keys() <= VOC_STATE_KEYS):
                if isinstance(state, dict):  # three keys shown, however many there are
                    others = (k for k in state if k not in VOC_STATE_KEYS)
                    other = [shown(k) for k in islice(others, 3)]
                    what = f"[{', '.join(other)}]"
                else:
                    what = describe(state)
                raise Refused(f"BUILD of a Voc with {what}: only idx2word and word2idx")
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
            build_function(target, state)
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
