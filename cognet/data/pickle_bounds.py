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
- **opcodes**: at most `MAX_OPCODES`; each makes one object, one memo entry or one
  reference at most, so what the reader holds is bounded whatever the file's length;
- **the end**: bytes after STOP are refused.

Error lines show a file's values through `printable` and `shown`: escaped and cut.
"""

from __future__ import annotations

import numpy as np

MAX_DEPTH = 32  # the benchmark files nest 8 deep at most (a dill class's code constants)
MAX_ELEMENTS = 1 << 25  # 33.5 million; MIMIC-III's records hold 0.63 million
MAX_LINE = 256  # a text opcode's line (a global's name, a protocol-0 integer)
MAX_OPCODES = 1 << 25  # each makes one object at most: MIMIC-III's records have 0.76 million
MAX_INT_BYTES = 8
KEY_BOUND = 1 << 31


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
    """What the reader knows of a container: depth, elements a walk visits, whether sealed."""

    __slots__ = ("obj", "depth", "size", "sealed")

    def __init__(self, obj: object, depth: int = 1, size: int = 1):
        self.obj, self.depth, self.size, self.sealed = obj, depth, size, False


class Bounds:
    """The shapes of what a reader has made, and the budgets it has left."""

    def __init__(self, file_length: int):
        self.shapes: dict[int, Shape] = {}  # id of a container -> its shape (holds it alive)
        self.budget = min(file_length, MAX_ELEMENTS)
        self.copy_budget = 2 * file_length
        self.walks_left = self.budget  # what stand-ins may walk, all their arguments together

    def shape(self, obj: object) -> Shape | None:
        return self.shapes.get(id(obj))

    def made(self, obj: object, children=()) -> object:
        """Register a new container holding `children`, checked against the bounds."""
        self.shapes[id(obj)] = Shape(obj)
        for child in children:
            self.put_in(obj, child)
        return obj

    def put_in(self, parent: object, child: object) -> None:
        """Count `child` as held by `parent`: depth and size grow, the child is sealed."""
        held = self.shape(parent)
        if held is None:
            held = self.shapes[id(parent)] = Shape(parent)
        if child is parent:
            raise Refused("a container that holds itself")
        inner = self.shape(child)
        depth, size = (inner.depth, inner.size) if inner else (0, 1)
        held.depth = max(held.depth, depth + 1)
        held.size += size
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
        references: all calls of a file together walk no more than one file's budget."""
        for argument in arguments:
            shape = self.shape(argument)
            self.walks_left -= shape.size if shape else 1
        if self.walks_left < 0:
            raise Refused(
                f"calls whose arguments hold more than {self.budget:,} elements in all "
                "(through shared references)"
            )

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
