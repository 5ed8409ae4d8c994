"""A bounded pickle reader: every opcode a benchmark file may hold, parsed by our code.

Python's unpicklers trust a stream's claims (see `cognet.data.pickle_bounds` for what goes
wrong and what is kept instead). This reader parses the stream itself, opcode by opcode
(`OPCODES`), and checks each against the bounds of `pickle_bounds.Bounds` as it builds: a
claimed length before it is read, an integer's size, a container's depth and walk, a key's
type, and the end of the file after STOP.

What a global names and what REDUCE, BUILD and NEWOBJ make is the subclass's choice
(`find_class`, `reduce`, `build`, `new`); OBJ, INST, persistent ids, extension codes and
out-of-band buffers are refused here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from cognet.data import pickle_bounds
from cognet.data.pickle_bounds import (
    MAX_INT_BYTES,
    MAX_LINE,
    Bounds,
    Malformed,
    Refused,
    Shape,
)


class BoundedReader(Bounds):
    """Reads one pickle from `data`; subclasses decide what globals and calls build."""

    def __init__(self, data: bytes):
        super().__init__(len(data))
        self.data, self.pos = data, 0
        self.stack: list = []
        self.marks: list[list] = []
        self.memo: dict[int, object] = {}
        self.opcode_at = 0

    # -- what a subclass decides ---------------------------------------------------------------

    def find_class(self, module: str, name: str) -> object:
        raise Refused(f"global {module}.{name}")

    def reduce(self, function: object, args: tuple) -> object:
        raise Refused("REDUCE")

    def build(self, target: object, state: object) -> object:
        raise Refused("BUILD")

    def new(self, cls: object, args: tuple, kwargs: dict) -> object:
        raise Refused("NEWOBJ")

    # -- bytes -----------------------------------------------------------------------------------

    def take(self, n: int, what: str = "bytes") -> bytes:
        """The next n bytes; a claim past the end is refused before anything is read."""
        left = len(self.data) - self.pos
        if n > left:
            raise Malformed(f"{what} claims {n:,} bytes; {left:,} are left in the file")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def length(self, size: int, what: str) -> bytes:
        (n,) = struct.unpack({1: "<B", 4: "<I", 8: "<Q"}[size], self.take(size, what))
        return self.take(n, what)

    def line(self) -> bytes:
        end = self.data.find(b"\n", self.pos, self.pos + MAX_LINE + 1)
        if end < 0:
            raise Malformed(f"a text opcode's line longer than {MAX_LINE} bytes or unended")
        text = self.data[self.pos : end]
        self.pos = end + 1
        return text

    def text_int(self) -> int:
        digits = self.line().rstrip(b"L")
        if len(digits) > 20 or not digits.lstrip(b"-").isdigit():
            raise Malformed("a text integer that is not one of at most 20 digits")
        return int(digits)

    # -- the stack -------------------------------------------------------------------------------

    def pop_mark(self) -> list:
        if not self.marks:
            raise Malformed("a MARK is missing")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def top(self) -> object:
        if not self.stack:
            raise Malformed("the stack is empty")
        return self.stack[-1]

    def pop(self) -> object:
        value = self.top()
        self.stack.pop()
        return value

    # -- reading ---------------------------------------------------------------------------------

    def load(self) -> object:
        for _ in range(pickle_bounds.MAX_OPCODES):
            self.opcode_at = self.pos
            code = self.take(1, "an opcode")[0]
            op = OPCODES.get(code)
            if op is None:
                raise Malformed(f"no pickle opcode 0x{code:02x}")
            if op is _stop:
                value = self.pop()
                if self.pos != len(self.data):
                    raise Refused(f"{len(self.data) - self.pos:,} bytes after STOP")
                return value
            op(self)
        raise Refused(f"more than {pickle_bounds.MAX_OPCODES:,} opcodes")


def _stop(r: BoundedReader) -> None:  # handled by load(); the marker of the STOP opcode
    pass


def _refuse(what: str) -> Callable[[BoundedReader], None]:
    def refuse(r: BoundedReader) -> None:
        raise Refused(f"{what} is not allowed")

    return refuse


def _push(make: Callable[[BoundedReader], object]) -> Callable[[BoundedReader], None]:
    return lambda r: r.stack.append(make(r))


def _long(r: BoundedReader, size: int) -> None:
    (n,) = struct.unpack("<B" if size == 1 else "<I", r.take(size, "an integer"))
    if n > MAX_INT_BYTES:
        raise Refused(f"an integer of {n:,} bytes (at most {MAX_INT_BYTES})")
    r.stack.append(int.from_bytes(r.take(n, "an integer"), "little", signed=True))


def _text(raw: bytes, encoding: str = "utf-8") -> str:
    try:
        return raw.decode(encoding, "surrogatepass" if encoding == "utf-8" else "strict")
    except UnicodeDecodeError:
        raise Malformed(f"text that is not {encoding}") from None


def _tuple(r: BoundedReader, n: int) -> None:
    if len(r.stack) < n:
        raise Malformed("the stack is too short")
    items = r.stack[len(r.stack) - n :]
    del r.stack[len(r.stack) - n :]
    r.stack.append(r.made(tuple(items), items))


def _append(r: BoundedReader, items: list) -> None:
    target = r.top()
    if not isinstance(target, list):
        raise Refused(f"APPEND to a {type(target).__name__}")
    r.changing(target)
    for item in items:
        r.put_in(target, item)
        target.append(item)


def _setitems(r: BoundedReader, items: list) -> None:
    target = r.top()
    if not isinstance(target, dict) or len(items) % 2:
        raise Refused(f"SETITEM on a {type(target).__name__}")
    r.changing(target)
    for k in range(0, len(items), 2):
        key, value = r.key(items[k]), items[k + 1]
        r.put_in(target, key)
        r.put_in(target, value)
        target[key] = value


def _additems(r: BoundedReader) -> None:
    items, target = r.pop_mark(), r.top()
    if not isinstance(target, set):
        raise Refused(f"ADDITEMS to a {type(target).__name__}")
    r.changing(target)
    for item in items:
        r.put_in(target, r.key(item))
        target.add(item)


def _frozenset(r: BoundedReader) -> None:
    items = [r.key(item) for item in r.pop_mark()]
    r.stack.append(r.made(frozenset(items), items))


def _dict(r: BoundedReader) -> None:
    items = r.pop_mark()
    r.stack.append(r.made({}))
    _setitems(r, items)


def _put(r: BoundedReader, index: int) -> None:
    if not 0 <= index < 1 << 32:
        raise Malformed("a memo index out of range")
    r.memo[index] = r.top()


def _get(r: BoundedReader, index: int) -> None:
    if index not in r.memo:
        raise Malformed("a memo reference to nothing")
    r.stack.append(r.memo[index])


def _global(r: BoundedReader, module: object, name: object) -> None:
    if not isinstance(module, str) or not isinstance(name, str):
        raise Malformed("a global whose names are not text")
    r.stack.append(r.find_class(module, name))


def _call(r: BoundedReader, made: object) -> None:
    r.charge(made)
    r.stack.append(made)


def _reduce(r: BoundedReader) -> None:
    args, function = r.pop(), r.pop()
    if not isinstance(args, tuple):
        raise Refused(f"REDUCE with {type(args).__name__} arguments")
    r.walked(args)
    _call(r, r.reduce(function, args))


def _build(r: BoundedReader) -> None:
    state, target = r.pop(), r.pop()
    r.changing(target)
    r.put_in(target, state)
    r.walked(state)
    made = r.build(target, state)
    if made is not target:
        shape = r.shape(target)
        r.shapes[id(made)] = Shape(made, shape.depth, shape.size)
    _call(r, made)


def _newobj(r: BoundedReader, kwargs: object) -> None:
    args, cls = r.pop(), r.pop()
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise Refused("NEWOBJ with arguments that are not a tuple")
    r.walked(args, kwargs)
    _call(r, r.made(r.new(cls, args, kwargs)))


def _u(fmt: str, size: int) -> Callable[[BoundedReader], int]:
    return lambda r: struct.unpack(fmt, r.take(size, "a number"))[0]


_u1, _u2, _u4, _i4 = _u("<B", 1), _u("<H", 2), _u("<I", 4), _u("<i", 4)


def _proto(r: BoundedReader) -> None:
    if _u1(r) > 5:
        raise Malformed("a pickle protocol above 5")


def _frame(r: BoundedReader) -> None:
    (n,) = struct.unpack("<Q", r.take(8, "a frame"))
    if n > len(r.data) - r.pos:
        raise Malformed(f"a frame claims {n:,} bytes; {len(r.data) - r.pos:,} are left")


def _pop(r: BoundedReader) -> None:
    r.pop() if r.stack else r.pop_mark()


def _newobj_ex(r: BoundedReader) -> None:
    kwargs = r.pop()
    _newobj(r, kwargs)


def _text_global(r: BoundedReader) -> None:
    module = _text(r.line(), "ascii")
    _global(r, module, _text(r.line(), "ascii"))


def _stack_global(r: BoundedReader) -> None:
    name, module = r.pop(), r.pop()
    _global(r, module, name)


def _float_line(r: BoundedReader) -> float:
    try:
        return float(r.line())
    except ValueError:
        raise Malformed("a text float that is not a number") from None


def _text_int_or_bool(r: BoundedReader) -> int:
    """Protocol 0's INT, where "01" and "00" are True and False."""
    flag = {b"01\n": True, b"00\n": False}.get(r.data[r.pos : r.pos + 3])
    if flag is None:
        return r.text_int()
    r.pos += 3
    return flag


def _mark(r: BoundedReader) -> None:
    r.marks.append(r.stack)
    r.stack = []


def _list(r: BoundedReader) -> None:
    items = r.pop_mark()
    r.stack.append(r.made([]))
    _append(r, items)


def _appends(r: BoundedReader) -> None:
    _append(r, r.pop_mark())


def _append1(r: BoundedReader) -> None:
    _append(r, [r.pop()])


def _setitem(r: BoundedReader) -> None:
    value, key = r.pop(), r.pop()
    _setitems(r, [key, value])


def _setitems_mark(r: BoundedReader) -> None:
    _setitems(r, r.pop_mark())


def _tuple_mark(r: BoundedReader) -> None:
    items = r.pop_mark()
    r.stack.append(r.made(tuple(items), items))


OPCODES: dict[int, Callable[[BoundedReader], None]] = {
    ord(k): v
    for k, v in {
        ".": _stop,
        "\x80": _proto,
        "\x95": _frame,
        "(": _mark,
        "0": _pop,
        "1": lambda r: r.pop_mark(),
        "2": lambda r: r.stack.append(r.top()),
        "N": _push(lambda r: None),
        "\x88": _push(lambda r: True),
        "\x89": _push(lambda r: False),
        "I": _push(_text_int_or_bool),
        "L": _push(lambda r: r.text_int()),
        "J": _push(_i4),
        "K": _push(_u1),
        "M": _push(_u2),
        "\x8a": lambda r: _long(r, 1),
        "\x8b": lambda r: _long(r, 4),
        "F": _push(_float_line),
        "G": _push(lambda r: struct.unpack(">d", r.take(8, "a float"))[0]),
        "T": _push(lambda r: _text(r.length(4, "a string"), "ascii")),
        "U": _push(lambda r: _text(r.length(1, "a string"), "ascii")),
        "B": _push(lambda r: r.length(4, "bytes")),
        "C": _push(lambda r: r.length(1, "bytes")),
        "\x8e": _push(lambda r: r.length(8, "bytes")),
        "\x96": _push(lambda r: bytearray(r.length(8, "a bytearray"))),
        "V": _push(lambda r: _text(r.line(), "raw-unicode-escape")),
        "X": _push(lambda r: _text(r.length(4, "text"))),
        "\x8c": _push(lambda r: _text(r.length(1, "text"))),
        "\x8d": _push(lambda r: _text(r.length(8, "text"))),
        "]": _push(lambda r: r.made([])),
        ")": _push(lambda r: r.made(())),
        "}": _push(lambda r: r.made({})),
        "\x8f": _push(lambda r: r.made(set())),
        "a": _append1,
        "e": _appends,
        "l": _list,
        "t": _tuple_mark,
        "\x85": lambda r: _tuple(r, 1),
        "\x86": lambda r: _tuple(r, 2),
        "\x87": lambda r: _tuple(r, 3),
        "d": _dict,
        "s": _setitem,
        "u": _setitems_mark,
        "\x90": _additems,
        "\x91": _frozenset,
        "p": lambda r: _put(r, r.text_int()),
        "q": lambda r: _put(r, _u1(r)),
        "r": lambda r: _put(r, _u4(r)),
        "\x94": lambda r: _put(r, len(r.memo)),
        "g": lambda r: _get(r, r.text_int()),
        "h": lambda r: _get(r, _u1(r)),
        "j": lambda r: _get(r, _u4(r)),
        "c": _text_global,
        "\x93": _stack_global,
        "R": _reduce,
        "b": _build,
        "\x81": lambda r: _newobj(r, {}),
        "\x92": _newobj_ex,
        "o": _refuse("OBJ (a class call)"),
        "i": _refuse("INST (a class call)"),
        "P": _refuse("a persistent id"),
        "Q": _refuse("a persistent id"),
        "\x82": _refuse("an extension code"),
        "\x83": _refuse("an extension code"),
        "\x84": _refuse("an extension code"),
        "\x97": _refuse("an out-of-band buffer"),
        "\x98": _refuse("an out-of-band buffer"),
    }.items()
}
