"""A small pickle assembler for the benchmark-file tests: streams in the shapes of
records_final.pkl, voc_final.pkl and ddi_A_final.pkl, built opcode by opcode (`op_*`), as
dill writes them, without dill."""

from __future__ import annotations

import struct

import numpy as np

DIAG = {0: "4019", 1: "25000", 2: "4280"}
PROC = {0: "3961", 1: "8872"}
MEDS = {0: "A01A", 1: "B01A", 2: "C07A", 3: "N02B"}
INTERACTING = [(0, 1), (2, 3)]


def op_global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def op_dill(name: str) -> bytes:
    return op_global("dill._dill", name)


def op_str(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def op_bytes(data: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(data)) + data


def op_int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


NONE, TRUE, FALSE = b"N", b"\x88", b"\x89"


def op_tuple(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def op_call(function: bytes, *args: bytes) -> bytes:
    return function + op_tuple(*args) + b"R"


def op_dict(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"}(" + b"".join(k + v for k, v in pairs) + b"u"


def op_build(target: bytes, state: bytes) -> bytes:
    return target + state + b"b"


def stream(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def op_code() -> bytes:
    """dill's `_create_code` with a code object's literal fields (the real files have 16)."""
    fields = [op_int(1), op_int(0), op_int(67), op_bytes(b"d\x00S\x00"), op_tuple(NONE)]
    fields += [op_tuple(op_str("idx2word")), op_str("processing.py"), op_str("__init__")]
    return op_call(op_dill("_create_code"), *fields)


def op_function(name: str = "__init__") -> bytes:
    main = op_global("__builtin__", "__main__")
    return op_call(
        op_dill("_create_function"), op_code(), main, op_str(name), NONE, NONE, op_dict(), NONE
    )


def op_voc_class() -> bytes:
    load_type = op_dill("_load_type")
    namespace = op_dict(
        (op_str("__module__"), op_str("__main__")),
        (op_str("__init__"), op_function("__init__")),
        (op_str("add_sentence"), op_function("add_sentence")),
        (op_str("__doc__"), NONE),
    )
    bases = op_tuple(op_call(load_type, op_str("object")))
    return op_call(
        op_dill("_create_type"), op_call(load_type, op_str("type")), op_str("Voc"), bases, namespace
    )


def op_voc(cls: bytes, words: dict[int, str]) -> bytes:
    idx2word = op_dict(*[(op_int(k), op_str(w)) for k, w in words.items()])
    word2idx = op_dict(*[(op_str(w), op_int(k)) for k, w in words.items()])
    state = op_dict((op_str("idx2word"), idx2word), (op_str("word2idx"), word2idx))
    return op_build(cls + b")\x81", state)  # NEWOBJ of the class, no arguments


def voc_stream() -> bytes:
    """voc_final.pkl's shape: the Voc class made once (memo 0), three instances."""
    vocs = [op_voc(op_voc_class() + b"p0\n", DIAG)]
    vocs += [op_voc(b"g0\n", words) for words in (PROC, MEDS)]
    names = [op_str(n) for n in ("diag_voc", "pro_voc", "med_voc")]
    return stream(op_dict(*zip(names, vocs, strict=True)))


def op_dtype(name: str = "f8", order: str = "<") -> bytes:
    state = op_tuple(op_int(3), op_str(order), NONE, NONE, NONE, op_int(-1), op_int(-1), op_int(0))
    return op_build(op_call(op_global("numpy", "dtype"), op_str(name), FALSE, TRUE), state)


def op_numpy_module(name: str = "numpy.core._multiarray_umath") -> bytes:
    return op_call(op_dill("_import_module"), op_str(name))


def ddi_stream(matrix: np.ndarray, module: str = "numpy.core._multiarray_umath") -> bytes:
    """ddi_A_final.pkl's shape: dill's `_create_array` over numpy's `_reconstruct`."""
    reconstruct = op_call(op_dill("_get_attr"), op_numpy_module(module), op_str("_reconstruct"))
    empty = op_tuple(op_global("numpy", "ndarray"), op_tuple(op_int(0)), op_bytes(b"b"))
    shape = op_tuple(*[op_int(n) for n in matrix.shape])
    raw = op_bytes(matrix.astype("<f8").tobytes())
    state = op_tuple(op_int(1), shape, op_dtype(), FALSE, raw)
    return stream(op_call(op_dill("_create_array"), reconstruct, empty, state, NONE))


def ddi_matrix() -> np.ndarray:
    matrix = np.zeros((len(MEDS), len(MEDS)))
    for a, b in INTERACTING:
        matrix[a, b] = matrix[b, a] = 1
    return matrix
