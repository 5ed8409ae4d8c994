"""Encoding, the second stage of scoring (plan -> encode -> decode -> emit).

Every row of a chunk that is scored or serves as history is encoded once (`encode_plan`), in
calls of similar lengths (`layout.encoder_calls`; on the CPU, one kind of code per call, by
the encoder parts). The outputs stay as each call returned them, call after call, in two
flat buffers (`layout.Layout`), from which the padded decoder-init inputs of each batch are
gathered (`init_index`: integer rows only; `init_inputs` gathers them on the host).

`Encoder`, the ONNX Runtime encoder session (and its parts), writes each call's outputs
straight into their place by IO binding: host arrays on the CPU or, on a GPU whose model has
the `init_gather` graphs, buffers in the device's memory, from which
`DeviceDecoder.init_gathered` builds each batch's decoder-init inputs there: encodings never
cross to the host and back (their round trip and regathering were a large share of the
GPU path's host time: BENCHMARKS.md "What was tried"). `HostEncoder` adapts any encoder
callable (host arrays in and out; the tests plug torch in) to the same `PlanEncoder`
interface.

An ensemble's members encode with their own encoders (`EnsembleEncoder`): one `Encodings`
per member, in one shared layout (`MemberEncodings`), from which `init_memories` builds
each member's memories with one index."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from cognet.core.graphspec import (
    ENCODER_OUTPUTS,
    INIT_GATHERED,
    TAKE_INPUTS,
    TAKE_OUTPUT,
)
from cognet.core.history import history_index
from cognet.core.vocab import Vocab
from cognet.runtime.device_selectors import INIT_GATHER, ORT_TYPES, SearchGraphs
from cognet.runtime.layout import Layout, encoder_calls
from cognet.runtime.plan import Plan


class PlanEncoder(Protocol):
    """What the scorer needs of an encoder: buffers for a chunk's layout, each call's
    outputs written into their place, and the buffers handed back once the chunk is
    decoded. `split`: it encodes one kind of code per call (the encoder parts), or all three
    together."""

    split: bool

    def new_encodings(self, lay: Layout) -> Encodings: ...

    def encode_into(self, inputs: Mapping[str, np.ndarray], enc: Encodings, k: int) -> None: ...

    def release(self, enc: Encodings) -> None: ...


class HostEncoder:
    """A `PlanEncoder` over an encoder callable (inputs -> `graphspec.ENCODER_OUTPUTS`, host
    arrays), its outputs copied into host buffers."""

    split = False  # the callable encodes the three kinds together

    def __init__(
        self, encode: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]], dim: int
    ):
        self.encode, self.dim = encode, dim

    def new_encodings(self, lay: Layout) -> Encodings:
        return new_encodings(lay, self.dim)

    def encode_into(self, inputs: Mapping[str, np.ndarray], enc: Encodings, k: int) -> None:
        store_encodings(enc, k, self.encode(inputs))

    def release(self, enc: Encodings) -> None:
        pass


class Encoder:
    """The encoder session, writing each call's outputs in place into a chunk's buffers
    (`Layout`) by IO binding: host arrays on the CPU, or, given the search graphs of
    a device that has the `init_gather` graphs, buffers on that device (the encodings then
    never leave it: `DeviceDecoder.init_gathered`). Called with inputs: host arrays."""

    def __init__(
        self,
        session: ort.InferenceSession,
        dim: int,
        search: SearchGraphs | None,
        parts: Mapping[str, ort.InferenceSession] | None = None,
    ):
        self.session, self.dim = session, dim
        self.parts = dict(parts) if parts else None  # {part: session} of ENCODER_PARTS
        self.split = self.parts is not None
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
        them measured slower (BENCHMARKS.md "What was tried")."""
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
        x, rows = TAKE_INPUTS
        io.bind_cpu_input(x, np.zeros((1, self.dim), self.dtype))
        io.bind_cpu_input(rows, np.zeros(1, np.int64))
        bind_rows(io, TAKE_OUTPUT, buffer, row, (1,), self.search.device)
        take.run_with_iobinding(io)

    def encode_into(self, inputs: Mapping[str, np.ndarray], enc: Encodings, k: int) -> None:
        """Run encoder call k of the layout (the encoder graph, or the encoder part of its
        one kind); its outputs land in their place in `enc`."""
        part = enc.layout.part(k)
        session = self.session if part is None else self.parts[part]
        io = session.io_binding()
        for key, value in inputs.items():
            io.bind_cpu_input(key, np.ascontiguousarray(value))
        device = None if self.search is None else self.search.device
        for name, (buffer, first, shape) in enc.layout.outputs(k).items():
            bind_rows(io, name, getattr(enc, buffer), first, shape, device)
        session.run_with_iobinding(io)


class EnsembleEncoder:
    """A `PlanEncoder` over the encoders of an ensemble's members: every call encoded by each
    member into its own buffers (`MemberEncodings`)."""

    def __init__(self, members: Iterable[PlanEncoder]):
        self.members = tuple(members)

    @property
    def search(self) -> SearchGraphs | None:
        """The search graphs that gather every member's encodings on the device, or None
        where any member's stay on the host."""
        found = [getattr(m, "search", None) for m in self.members]
        return found[0] if all(s is not None for s in found) else None

    @property
    def split(self) -> bool:
        """Whether every member encodes by its parts, one kind of code per call."""
        return all(m.split for m in self.members)

    @property
    def dtype(self) -> np.dtype:
        """The encodings' type (the members share their variant)."""
        return getattr(self.members[0], "dtype", np.dtype(np.float32))

    def new_encodings(self, lay: Layout) -> MemberEncodings:
        return MemberEncodings(lay, tuple(m.new_encodings(lay) for m in self.members))

    def encode_into(self, inputs: Mapping[str, np.ndarray], enc: MemberEncodings, k: int) -> None:
        for member, encodings in zip(self.members, enc.members, strict=True):
            member.encode_into(inputs, encodings, k)

    def release(self, enc: MemberEncodings) -> None:
        for member, encodings in zip(self.members, enc.members, strict=True):
            member.release(encodings)


@dataclass
class Encodings:
    """A chunk's encoder outputs in their `Layout`: numpy arrays on the host, or handles where
    the encoder wrote them (a GPU's memory)."""

    layout: Layout
    codes: Any  # [layout.code_rows, s]
    visits: Any  # [layout.visit_rows, s]


@dataclass
class MemberEncodings:
    """A chunk's encodings by each member of an ensemble (`EnsembleEncoder`), one layout."""

    layout: Layout
    members: tuple[Encodings, ...]


def new_encodings(lay: Layout, dim: int, dtype=np.float32) -> Encodings:
    """Host buffers of a layout (zeros: the padding rows must be)."""
    z = np.zeros
    return Encodings(lay, z((lay.code_rows, dim), dtype), z((lay.visit_rows, dim), dtype))


def encoder_inputs(
    plan: Plan, rows: np.ndarray, vocab: Vocab, kinds=(True, True, True)
) -> dict[str, np.ndarray]:
    """Padded id matrices [len(rows), L] of `graphspec.ENCODER_INPUTS` (of the kinds asked)."""
    every = (
        ("diagnoses", plan.diag, vocab.diag_pad),
        ("procedures", plan.proc, vocab.proc_pad),
        ("medications", plan.meds, vocab.med_pad),
    )
    return {name: r.pad(rows, pad) for (name, r, pad), on in zip(every, kinds, strict=True) if on}


def store_encodings(enc: Encodings, k: int, out: Mapping[str, np.ndarray]) -> None:
    """Copy the outputs of encoder call k (host arrays) into their place."""
    for name, (buffer, first, shape) in enc.layout.outputs(k).items():
        rows = int(np.prod(shape))
        getattr(enc, buffer)[first : first + rows] = np.asarray(out[name]).reshape(rows, -1)


def init_index(
    plan: Plan, lay: Layout, targets: np.ndarray, histories
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The decoder-init inputs (`graphspec.INIT_INPUTS`) of the visits `targets` (chunk
    rows; histories: theirs, as `history_index` takes them), as (buffer rows of the inputs
    of `graphspec.INIT_GATHERED`, the other inputs); padding positions point at the
    buffer's zero row."""
    gather: dict[str, np.ndarray] = {}
    rest: dict[str, np.ndarray] = {}
    zero_code, zero_visit = lay.code_rows - 1, lay.visit_rows - 1
    for kind, ragged in (("diag", plan.diag), ("proc", plan.proc)):
        lengths = ragged.lengths[targets]
        k = np.arange(max(1, int(lengths.max(initial=0))))
        mask = k < lengths[:, None]
        gather[f"{kind}_enc"] = np.where(mask, lay.at[kind][targets, None] + k, zero_code)
        rest[f"{kind}_mask"] = mask.astype(np.float32)
    gather["v_d"], gather["v_p"] = lay.at["v_d"][targets], lay.at["v_p"][targets]
    index = history_index(histories, plan.meds)
    real = index["hist_mask"] > 0
    gather["hist_v_d"] = np.where(real, lay.at["v_d"][index["hist_index"]], zero_visit)
    gather["hist_v_p"] = np.where(real, lay.at["v_p"][index["hist_index"]], zero_visit)
    rest["hist_mask"] = index["hist_mask"]
    slot = lay.at["meds"][index["slot_row"]] + index["slot_pos"]
    gather["slot_enc"] = np.where(index["slot_mask"] > 0, slot, zero_code)
    for name in ("slot_mask", "slot_visit", "slot_med"):
        rest[name] = index[name]
    return gather, rest


def init_inputs(
    plan: Plan, enc: Encodings, targets: np.ndarray, histories
) -> dict[str, np.ndarray]:
    """Decoder-init inputs (`graphspec.INIT_INPUTS`) of the visits `targets` (chunk rows),
    gathered on the host."""
    return _gathered(enc, *init_index(plan, enc.layout, targets, histories))


def _gathered(enc: Encodings, gather: Mapping[str, np.ndarray], rest: Mapping) -> dict:
    """`rest` and the inputs of `graphspec.INIT_GATHERED` taken from host buffers at the
    buffer rows `gather` (`init_index`)."""
    return {**rest, **{name: getattr(enc, buf)[gather[name]] for name, buf, _ in INIT_GATHERED}}


def init_memories(
    decoder, plan: Plan, enc: Encodings | MemberEncodings, targets: np.ndarray, histories
) -> tuple[Any, dict[str, np.ndarray]]:
    """(the decoder's memories of the visits `targets`, the decoder-init inputs that are no
    encodings: `init_index`'s), each member's from its own encodings, gathered on the host
    or, for encodings on a device, there (`DeviceDecoder.init_gathered`). An ensemble
    (`MemberEncodings`, `decoder` an `EnsembleSession`): a tuple of the members' memories."""
    gather, rest = init_index(plan, enc.layout, targets, histories)

    def init(member, encodings: Encodings):
        if isinstance(encodings.codes, np.ndarray):
            return member.init(_gathered(encodings, gather, rest))
        return member.init_gathered(encodings, gather, rest)

    if isinstance(enc, MemberEncodings):
        members = zip(decoder.members, enc.members, strict=True)
        return tuple(init(m, e) for m, e in members), rest
    return init(decoder, enc), rest


def encode_plan(
    encoder: PlanEncoder,
    plan: Plan,
    vocab: Vocab,
    cells: int,
    batch: int,
    run: Callable[[Callable, Iterable], Iterable] = map,
) -> Encodings:
    """Encode every row of a plan that is scored or serves as history (`plan.encode_rows`),
    in the calls of `layout.encoder_calls` (by kind of code for an encoder that runs its
    parts, `split`), on `run`'s streams."""
    lay = encoder_calls(plan, encoder.split, cells, batch)
    parts = lay.parts
    enc = encoder.new_encodings(lay)

    def encode(k: int) -> None:
        encoder.encode_into(encoder_inputs(plan, parts[k], vocab, lay.kinds[k]), enc, k)

    for _ in run(encode, range(len(parts))):
        pass
    return enc


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
