"""What a benchmark pickle may build, checked as `cognet.data.pickle_reader` builds it.

Python's own unpicklers trust what a stream claims: the C one allocates a claimed length
before the bytes exist, hashing a key nested a million deep recurses in C until the process
dies, and the memo lets a few kilobytes name the same list millions of times. The reader
keeps, by construction:

- **lengths**: a length a stream claims (bytes, text, a frame) is compared with the bytes
  left in the file before anything is read or allocated;
- **integers**: at most 8 bytes (LONG1 and LONG4), 20 digits in text opcodes; memo indices
  below 2^32;
- **depth**: every container carries its nesting depth; one deeper than `MAX_DEPTH` is
  refused when it is made, before anything hashes, compares or prints it;
- **size through shared references**: every container carries the number of elements a walk
  of it visits, a shared one counted each time it is held. Without the memo each element
  costs at least one byte of the file, so a walk larger than the file's length in bytes (or
  than `MAX_ELEMENTS`) can only come from sharing, and is refused;
- **no change after use**: a list, dict, set or object put inside another is never changed
  again, so depth and size stay true and no cycle can form;
- **keys**: dict keys and set members are strings, bytes or integers below 2^31 in size, so
  no hash can recurse or be crafted to collide;
- **copies**: bytes that the stand-ins copy (arrays, encoded text) are counted, at most
  twice the file's length;
- **calls**: the arguments of every REDUCE, BUILD and NEWOBJ together hold no more elements
  than the budget of one walk, so a stand-in that checks its arguments cannot be made to
  check one shared tuple a million times;
- **memory**: every object the reader makes or holds (a container, empty or not, an
  element, a stack slot, a MARK, a memo entry, its own record of a container, what a
  stand-in makes) is charged before it is allocated, at an upper bound of what CPython
  allocates for it (`ALLOC`). All charges together stay under `MEMORY_PER_BYTE` bytes per
  byte of the file (`MEMORY_FLOOR` for a file under 656 bytes), and under as many per byte
  read so far plus the floor, so a flood of opcodes that cost more than they are long is
  refused within its first kilobytes;
- **the stack**: at most `MAX_STACK` items and marks wait on it (Python's pickler leaves
  at most 1,000 items of a list, dict or set there at a time);
- **the memo**: an entry only for an object an opcode made (no more entries than objects),
  at the next index or one already used, as Python's pickler numbers them;
- **opcodes**: at most `MAX_OPCODES`, so time is bounded by the file's length;
- **the end**: bytes after STOP are refused.

Error lines show a file's values through `printable` and `shown`: escaped and cut.
"""

from __future__ import annotations

import sys

import numpy as np

MAX_DEPTH = 32  # the benchmark files nest 8 deep at most (a dill class's code constants)
MAX_ELEMENTS = 1 << 25  # 33.5 million; MIMIC-III's records hold 0.63 million
MAX_LINE = 256  # a text opcode's line (a global's name, a protocol-0 integer)
MAX_OPCODES = 1 << 25  # each makes one object at most: MIMIC-III's records have 0.76 million
MAX_INT_BYTES = 8
KEY_BOUND = 1 << 31
MAX_STACK = 1 << 16  # items and marks waiting; the benchmark files leave 2,014 at most
MEMORY_PER_BYTE = 100  # bytes of memory per byte of file: a 10 MB file holds under 1 GB
MEMORY_FLOOR = 1 << 16  # what any file may use, however short (a 5-byte pickle of [] takes 450)

# What CPython (64-bit) allocates, rounded up to pymalloc's 16-byte sizes and with room for
# over-allocation and a table's resize: what the reader charges before it allocates.
ALLOC = {
    "ref": 16,  # a reference in a list, a tuple, the stack or the memo (8, over-allocated)
    "entry": 192,  # an entry of a dict or a set: table slots grown 4 times, and the resize
    "number": 48,  # an int of at most 8 bytes (28 + 4 a 30-bit digit), a float (24)
    "object": 64,  # an empty list (56) or dict (64)
    "set": 240,  # an empty set or frozenset (a table of 8 slots)
    "bytes": 48,  # a bytes object, plus its length (a slice of the file is a copy)
    "text": 80,  # a str, plus 4 bytes a character
    "shape": 192,  # the reader's record of a container: a Shape and its entry in `shapes`
    "mark": 80,  # a MARK: the list of the items after it and its place in `marks`
    "call": 1024,  # a stand-in's own objects, plus twice the text and bytes it is given
}


def printable(text: str, limit: int = 80) -> str:
    """Text of a file as an error line may show it: control characters, escape sequences and
    invisible formatting (NUL, newlines, ESC, U+202E) written as escapes, cut to `limit`."""
    cut = text[:limit]
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return out + ("..." if len(text) > limit else "")


def shown(value: object, limit: int = 40) -> str:
    """A value of a file in an error line: text quoted and escaped, numbers as they are,
    anything else by its type; never longer than about `limit` characters."""
    if isinstance(value, str):
        return f"'{printable(value, limit)}'"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value):,} bytes"
    if isinstance(value, (bool, float, np.bool_, np.floating)) or value is None:
        return repr(value)[:limit]
    if isinstance(value, (int, np.integer)):
        n = int(value)
        return str(n) if n.bit_length() <= 64 else f"an integer of {n.bit_length():,} bits"
    if (
        isinstance(value, tuple)
        and len(value) <= 4
        and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
    ):
        return f"({', '.join(shown(v) for v in value)})"
    return f"a {type(value).__name__}"


class Refused(Exception):
    """A stream asked for something these files never need; `load` adds the file's name."""


class Malformed(Exception):
    """A stream that is not a pickle (truncated, corrupt); the message never holds its bytes."""


class Shape:
    """What the reader knows of a container: depth, elements a walk visits, bytes of text
    and arrays a walk meets (`payload`), whether sealed."""

    __slots__ = ("obj", "depth", "size", "payload", "sealed")

    def __init__(self, obj: object, depth: int = 1, size: int = 1, payload: int = 0):
        self.obj, self.depth, self.size, self.payload = obj, depth, size, payload
        self.sealed = False


def weight(value: object) -> int:
    """Bytes a stand-in could copy of `value` itself: text, bytes and arrays."""
    if isinstance(value, (str, bytes, bytearray, np.ndarray)):
        return sys.getsizeof(value)
    return 0


class Bounds:
    """The shapes of what a reader has made, and the budgets it has left."""

    def __init__(self, file_length: int):
        self.shapes: dict[int, Shape] = {}  # id of a container -> its shape (holds it alive)
        self.budget = min(file_length, MAX_ELEMENTS)
        self.copy_budget = 2 * file_length
        self.walks_left = self.budget  # what stand-ins may walk, all their arguments together
        self.memory = max(MEMORY_PER_BYTE * file_length, MEMORY_FLOOR)
        self.spent = 0  # bytes charged so far (`spend`)
        self.pos = 0  # bytes of the file read so far; the reader advances it

    def spend(self, nbytes: int) -> None:
        """Charge `nbytes` of memory about to be allocated; refused past the budget (every
        charge is an upper bound and none is given back, so the budget bounds the peak)."""
        self.spent += nbytes
        if self.spent > MEMORY_PER_BYTE * self.pos + MEMORY_FLOOR or self.spent > self.memory:
            raise Refused(
                f"more memory than {MEMORY_PER_BYTE} bytes per byte of the file "
                f"({self.spent:,} bytes by byte {self.pos:,})"
            )

    def shape(self, obj: object) -> Shape | None:
        return self.shapes.get(id(obj))

    def record(self, obj: object) -> Shape:
        """A new record of `obj` as a container of depth 1 holding nothing yet."""
        self.spend(ALLOC["shape"])
        shape = self.shapes[id(obj)] = Shape(obj)
        return shape

    def made(self, obj: object, children=()) -> object:
        """Register a new container holding `children`, checked against the bounds."""
        self.record(obj)
        for child in children:
            self.put_in(obj, child)
        return obj

    def put_in(self, parent: object, child: object) -> None:
        """Count `child` as held by `parent`: depth, size and payload grow, the child is
        sealed."""
        held = self.shape(parent) or self.record(parent)
        if child is parent:
            raise Refused("a container that holds itself")
        inner = self.shape(child)
        if inner:
            depth, size, payload = inner.depth, inner.size, inner.payload
        else:
            depth, size, payload = 0, 1, weight(child)
        held.depth = max(held.depth, depth + 1)
        held.size += size
        held.payload += payload
        if held.depth > MAX_DEPTH:
            raise Refused(f"nesting deeper than {MAX_DEPTH}")
        if held.size > self.budget:
            raise Refused(
                f"more than {self.budget:,} elements to walk through shared references "
                "(a walk of a file without sharing visits at most one per byte)"
            )
        if inner:
            inner.sealed = True

    def changing(self, target: object) -> None:
        held = self.shape(target)
        if held is not None and held.sealed:
            raise Refused(f"a {type(target).__name__} changed after it was put inside another")

    def key(self, key: object) -> object:
        """A dict key or set member: only values whose hash is flat and not craftable."""
        if isinstance(key, (str, bytes)):
            return key
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            if -KEY_BOUND < key < KEY_BOUND:
                return key
            raise Refused(
                f"a key integer out of range (|key| >= 2^31, {int(key).bit_length()} bits)"
            )
        raise Refused(f"a key that is a {type(key).__name__} (only strings and small integers)")

    def walked(self, *arguments: object) -> None:
        """Count the arguments a stand-in may walk, each as large as it is through shared
        references: all calls of a file together walk no more than one file's budget. The
        call's memory is charged first: a stand-in keeps a few small objects, copies the
        arguments it is handed (a reference each) and at most twice their text, bytes and
        arrays."""
        size = payload = held = 0
        for argument in arguments:
            shape = self.shape(argument)
            size += shape.size if shape else 1
            payload += shape.payload if shape else weight(argument)
            held += len(argument) if isinstance(argument, (tuple, list, dict)) else 1
        self.walks_left -= size
        if self.walks_left < 0:
            raise Refused(
                f"calls whose arguments hold more than {self.budget:,} elements in all "
                "(through shared references)"
            )
        self.spend(ALLOC["call"] + 2 * (ALLOC["ref"] * held + payload))

    def charge(self, made: object) -> None:
        """Count the bytes a stand-in copied (an array, encoded text)."""
        if isinstance(made, (np.ndarray, np.generic)):
            n = made.nbytes
        elif isinstance(made, (bytes, bytearray)):
            n = len(made)
        else:
            return
        self.copy_budget -= n
        if self.copy_budget < 0:
            raise Refused("arrays and bytes copied past twice the file's length (shared bytes)")
