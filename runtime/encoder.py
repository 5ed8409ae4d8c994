"""The encoder session writing in place: each encoder call's outputs go straight into a
chunk's buffers (`cognet.runtime.assemble.Layout`) by IO binding, host arrays on the CPU or,
on a GPU whose model has the `init_gather` graphs, buffers in the device's memory, from which
`DeviceDecoder.init_gathered` builds each batch's decoder-init inputs there: encodings never
cross to the host and back (on an H100 their round trip and regathering took about a third
of the host's time, docs/gpu/results-h100-search.md)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnxruntime as ort

from cognet.core.graphspec import ENCODER_OUTPUTS
from cognet.runtime.assemble import Encodings, Layout, new_encodings
from cognet.runtime.search import INIT_GATHER, ORT_TYPES, SearchGraphs


class Encoder:
    """The encoder session, writing each call's outputs in place into a chunk's buffers
    (`assemble.Layout`) by IO binding: host arrays on the CPU, or, given the search graphs of
    a device that has the `init_gather` graphs, buffers on that device (the encodings then
    never leave it: `DeviceDecoder.init_gathered`). Called with inputs: host arrays."""

    def __init__(self, session: ort.InferenceSession, dim: int, search: SearchGraphs | None):
        self.session, self.dim = session, dim
        types = {o.name: o.type for o in session.get_outputs()}
        self.dtype = np.dtype(ORT_TYPES[types["diag_enc"]])
        self._gather = INIT_GATHER.get(types["diag_enc"])
        on_device = search is not None and search.device is not None
        self.search = search if on_device and self._gather in search.sessions else None
        self._spare: tuple[Any, Any] | None = None  # buffers of the last chunk, for the next
        self._lock = threading.Lock()

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.session.run(list(ENCODER_OUTPUTS), dict(inputs))
        return dict(zip(ENCODER_OUTPUTS, out, strict=True))

    def new_encodings(self, lay: Layout) -> Encodings:
        """Buffers for a layout, their padding rows zero: host arrays, fresh per chunk; or on
        the device when it can gather there, at least as long as the layout needs, the last
        chunk's reused when long enough and `release`d (allocating and freeing device memory
        synchronises the device; not measured). Host buffers are fresh per chunk: reusing
        them measured slower (BENCHMARKS.md, "The GPU path's host side")."""
        if self.search is None:
            return new_encodings(lay, self.dim, self.dtype)
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None or _rows(spare[0]) < lay.code_rows or _rows(spare[1]) < lay.visit_rows:
            spare = None  # the old one goes first
            spare = tuple(
                self._allocate(int(rows * 1.25)) for rows in (lay.code_rows, lay.visit_rows)
            )
        codes, visits = spare
        for buffer, row in ((codes, lay.code_rows - 1), (visits, lay.visit_rows - 1)):
            self._zero_row(buffer, row)
        return Encodings(lay, codes, visits)

    def release(self, enc: Encodings) -> None:
        """The chunk is decoded: its device buffers may serve the next."""
        if self.search is not None:
            with self._lock:
                self._spare = (enc.codes, enc.visits)

    def _allocate(self, rows: int) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_shape_and_type(
            [rows, self.dim], self.dtype, *self.search.device
        )

    def _zero_row(self, buffer: ort.OrtValue, row: int) -> None:
        """Zero one row of a device buffer: the take graph writes it there."""
        take = self.search.sessions[f"take_{self.dtype.name}"]
        io = take.io_binding()
        io.bind_cpu_input("x", np.zeros((1, self.dim), self.dtype))
        io.bind_cpu_input("rows", np.zeros(1, np.int64))
        bind_rows(io, "y", buffer, row, (1,), self.search.device)
        take.run_with_iobinding(io)

    def encode_into(self, inputs: Mapping[str, np.ndarray], enc: Encodings, k: int) -> None:
        """Run encoder call k of the layout; its outputs land in their place in `enc`."""
        io = self.session.io_binding()
        for key, value in inputs.items():
            io.bind_cpu_input(key, np.ascontiguousarray(value))
        device = None if self.search is None else self.search.device
        for name, (buffer, first, shape) in enc.layout.outputs(k).items():
            bind_rows(io, name, getattr(enc, buffer), first, shape, device)
        self.session.run_with_iobinding(io)


def _rows(buffer: ort.OrtValue) -> int:
    return buffer.shape()[0]


def bind_rows(io: ort.IOBinding, name: str, buffer, row: int, shape, device=None) -> None:
    """Bind output `name` to the rows row.. of a 2-D buffer [rows, D] (a host array, or an
    OrtValue on `device`), viewed as shape + (D,): the graph writes there."""
    if isinstance(buffer, np.ndarray):
        kind, rows, width = ("cpu", 0), buffer.shape[0], buffer.shape[1]
        dtype, base = buffer.dtype, buffer.ctypes.data
    else:
        kind, (rows, width) = device, buffer.shape()
        dtype, base = np.dtype(ORT_TYPES[buffer.data_type()]), buffer.data_ptr()
    count = int(np.prod(shape))
    if not 0 <= row <= rows - count:
        raise ValueError(f"{name}: rows {row}..{row + count} outside a buffer of {rows}")
    at = base + row * width * dtype.itemsize
    io.bind_output(name, kind[0], kind[1], dtype, [*shape, width], at)
