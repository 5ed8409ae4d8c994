"""A bounded pickle reader: every opcode a benchmark file may hold, parsed by our code.

Python's unpicklers trust a stream's claims (see `cognet.data.pickle_bounds` for what goes
wrong and what is kept instead). This reader parses the stream itself, opcode by opcode
(`OPCODES`), and checks each against the bounds of `pickle_bounds.Bounds` as it builds: a
claimed length before it is read, the memory of every object before it is made, an
integer's size, a container's depth and walk, a key's type, and the end of the file after
STOP.

A value is read exactly as Python's C unpickler reads it, or refused. Protocol 0's text
numbers are where the two could part: `I010` is 8 to Python (C's strtol, base 0), `I 5`,
`I+5` and `I1_0` are numbers to it, `I-0` is False, `L010L` an error. So text integers
are read only in the form Python's pickler writes, `0` or an optional `-` and digits
without a leading zero (`00` and `01` are INT's False and True; LONG's one trailing `L`
is optional, as for Python); text floats only as `repr` writes them (digits, point,
exponent, `inf`, `nan`), and one past the float range is refused (Python raises); memo
indices as digits. Anything else is refused.

What a global names and what REDUCE, BUILD and NEWOBJ make is the subclass's choice
(`find_class`, `reduce`, `build`, `new`); OBJ, INST, persistent ids, extension codes and
out-of-band buffers are refused here. The loop is Python's own bytecode, so SIGTERM and
SIGINT (raised as exceptions by `cognet.core.interrupt.terminating`) end a read at the next
opcode; `kill_point("reading")` lets the tests signal a read in progress.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

from cognet.core.interrupt import kill_point
from cognet.data import pickle_bounds
from cognet.data.pickle_bounds import (
    ALLOC,
    MAX_INT_BYTES,
    MAX_LINE,
    MAX_STACK,
    Bounds,
    Malformed,
    Refused,
    Shape,
)

DECIMAL = re.compile(rb"0|-?[1-9][0-9]{0,19}")  # how Python's pickler writes INT
LONG = re.compile(rb"(?:0|-?[1-9][0-9]{0,19})L?")  # and LONG, whose L Python may do without
MEMO_INDEX = re.compile(rb"[0-9]{1,20}")  # PUT and GET: base 10 to Python, zeros and all
FLOAT = re.compile(rb"-?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|inf|nan)")
SIGNAL_EVERY = 1 << 16  # opcodes between two kill points (tests only; a signal needs none)


class BoundedReader(Bounds):
    """Reads one pickle from `data`; subclasses decide what globals and calls build."""

    def __init__(self, data: bytes):
        super().__init__(len(data))
        self.data, self.pos = data, 0
        self.stack: list = []
        self.marks: list[list] = []
        self.below = 0  # items and marks held under the current mark
        self.memo: list = []  # indices in order (`_put`), so a list: 8 bytes an entry
        self.made_count = 0  # objects the opcodes made: no more memo entries than that
        self.puts = 0  # memo entries written (PUT, BINPUT, LONG_BINPUT, MEMOIZE)
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
        """The next n bytes; a claim past the end is refused before anything is read, and the
        copy is charged before it is made."""
        left = len(self.data) - self.pos
        if n > left:
            raise Malformed(f"{what} claims {n:,} bytes; {left:,} are left in the file")
        start = self.pos
        self.pos += n
        if n > 1:  # bytes of length 0 and 1 are CPython's own, never allocated
            self.spend(ALLOC["bytes"] + n)
        return self.data[start : self.pos]

    def number(self, fmt: str, what: str) -> int | float:
        """A fixed-size number of the stream, read in place (no copy)."""
        size = struct.calcsize(fmt)
        left = len(self.data) - self.pos
        if size > left:
            raise Malformed(f"{what} claims {size:,} bytes; {left:,} are left in the file")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def length(self, size: int, what: str) -> bytes:
        return self.take(self.number({1: "<B", 4: "<I", 8: "<Q"}[size], what), what)

    def line(self) -> bytes:
        end = self.data.find(b"\n", self.pos, self.pos + MAX_LINE + 1)
        if end < 0:
            raise Malformed(f"a text opcode's line longer than {MAX_LINE} bytes or unended")
        text = self.take(end - self.pos, "a line")
        self.pos += 1
        return text

    def text_number(self, form: re.Pattern, what: str) -> bytes:
        digits = self.line()
        if not form.fullmatch(digits):  # I010 is 8 to Python, I+1 True: no guessing
            raise Malformed(f"{what} not in the form Python's pickler writes")
        return digits

    # -- the stack -------------------------------------------------------------------------------

    def push(self, value: object, made: bool = True) -> None:
        """Put `value` on the stack (its own memory already charged); `made`: a new object,
        one more the memo may name (GET and DUP push one already made)."""
        if len(self.stack) + self.below >= MAX_STACK:
            raise Refused(f"more than {MAX_STACK:,} items waiting on the stack")
        self.spend(ALLOC["ref"])
        self.made_count += made
        self.stack.append(value)

    def mark(self) -> None:
        if len(self.stack) + self.below >= MAX_STACK:
            raise Refused(f"more than {MAX_STACK:,} items waiting on the stack")
        self.spend(ALLOC["mark"])
        self.below += len(self.stack) + 1
        self.marks.append(self.stack)
        self.stack = []

    def pop_mark(self) -> list:
        if not self.marks:
            raise Malformed("a MARK is missing")
        items, self.stack = self.stack, self.marks.pop()
        self.below -= len(self.stack) + 1
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
        for count in range(pickle_bounds.MAX_OPCODES):
            if not count % SIGNAL_EVERY and count:
                kill_point("reading")
            self.opcode_at = self.pos
            if self.pos >= len(self.data):
                raise Malformed("an opcode claims 1 bytes; 0 are left in the file")
            code = self.data[self.pos]
            self.pos += 1
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


def _push(make: Callable[[BoundedReader], object], cost: int = 0) -> Callable:
    """An opcode that makes one object of at most `cost` bytes (beyond what `make` charges
    itself) and pushes it."""

    def push(r: BoundedReader) -> None:
        r.spend(cost)
        r.push(make(r))

    return push


def _long(r: BoundedReader, size: int) -> None:
    n = r.number("<B" if size == 1 else "<I", "an integer")
    if n > MAX_INT_BYTES:
        raise Refused(f"an integer of {n:,} bytes (at most {MAX_INT_BYTES})")
    raw = r.take(n, "an integer")
    r.spend(ALLOC["number"])
    r.push(int.from_bytes(raw, "little", signed=True))


def _text(r: BoundedReader, raw: bytes, encoding: str = "utf-8") -> str:
    r.spend(ALLOC["text"] + 4 * len(raw))  # a character takes 4 bytes at most, and 1 byte
    try:
        return raw.decode(encoding, "surrogatepass" if encoding == "utf-8" else "strict")
    except UnicodeDecodeError:
        raise Malformed(f"text that is not {encoding}") from None


def _new_tuple(r: BoundedReader, items: list) -> None:
    r.spend(ALLOC["object"] + ALLOC["ref"] * len(items))
    r.push(r.made(tuple(items), items))


def _tuple(r: BoundedReader, n: int) -> None:
    if len(r.stack) < n:
        raise Malformed("the stack is too short")
    items = r.stack[len(r.stack) - n :]
    del r.stack[len(r.stack) - n :]
    _new_tuple(r, items)


def _append(r: BoundedReader, items: list) -> None:
    target = r.top()
    if not isinstance(target, list):
        raise Refused(f"APPEND to a {type(target).__name__}")
    r.changing(target)
    r.spend(ALLOC["ref"] * len(items))
    for item in items:
        r.put_in(target, item)
    target.extend(items)


def _setitems(r: BoundedReader, items: list) -> None:
    target = r.top()
    if not isinstance(target, dict) or len(items) % 2:
        raise Refused(f"SETITEM on a {type(target).__name__}")
    r.changing(target)
    r.spend(ALLOC["entry"] * (len(items) // 2))
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
    r.spend(ALLOC["entry"] * len(items))
    for item in items:
        r.put_in(target, r.key(item))
        target.add(item)


def _frozenset(r: BoundedReader) -> None:
    items = [r.key(item) for item in r.pop_mark()]
    r.spend(ALLOC["set"] + (ALLOC["entry"] + ALLOC["ref"]) * len(items))
    r.push(r.made(frozenset(items), items))


def _dict(r: BoundedReader) -> None:
    items = r.pop_mark()
    r.spend(ALLOC["object"])
    r.push(r.made({}))
    _setitems(r, items)


def _list(r: BoundedReader) -> None:
    items = r.pop_mark()  # the list of the items after the MARK becomes the list itself
    r.push(r.made(items, items))


def _put(r: BoundedReader, index: int) -> None:
    value = r.top()
    r.puts += 1
    if r.puts > r.made_count:
        raise Refused("more memo entries than objects made (Python memoizes each object once)")
    if index == len(r.memo):
        r.spend(ALLOC["ref"])
        r.memo.append(value)
    elif 0 <= index < len(r.memo):
        r.memo[index] = value
    else:
        raise Refused(
            f"memo index {index:,} out of order (Python's pickler numbers them 0, 1, 2, ...)"
        )


def _get(r: BoundedReader, index: int) -> None:
    if not 0 <= index < len(r.memo):
        raise Malformed("a memo reference to nothing")
    r.push(r.memo[index], made=False)


def _global(r: BoundedReader, module: object, name: object) -> None:
    if not isinstance(module, str) or not isinstance(name, str):
        raise Malformed("a global whose names are not text")
    r.spend(ALLOC["object"])
    r.push(r.find_class(module, name))


def _call(r: BoundedReader, made: object) -> None:
    r.charge(made)
    r.push(made)


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
        r.spend(ALLOC["shape"])
        r.shapes[id(made)] = Shape(made, shape.depth, shape.size, shape.payload)
    _call(r, made)


def _newobj(r: BoundedReader, kwargs: object) -> None:
    args, cls = r.pop(), r.pop()
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise Refused("NEWOBJ with arguments that are not a tuple")
    r.walked(args, kwargs)
    _call(r, r.made(r.new(cls, args, kwargs)))


def _u(fmt: str) -> Callable[[BoundedReader], int]:
    return lambda r: r.number(fmt, "a number")


_u1, _u2, _u4, _i4 = _u("<B"), _u("<H"), _u("<I"), _u("<i")


def _proto(r: BoundedReader) -> None:
    if _u1(r) > 5:
        raise Malformed("a pickle protocol above 5")


def _frame(r: BoundedReader) -> None:
    n = r.number("<Q", "a frame")
    if n > len(r.data) - r.pos:
        raise Malformed(f"a frame claims {n:,} bytes; {len(r.data) - r.pos:,} are left")


def _pop(r: BoundedReader) -> None:
    r.pop() if r.stack else r.pop_mark()


def _dup(r: BoundedReader) -> None:
    r.push(r.top(), made=False)


def _newobj_ex(r: BoundedReader) -> None:
    kwargs = r.pop()
    _newobj(r, kwargs)


def _text_global(r: BoundedReader) -> None:
    module = _text(r, r.line(), "ascii")
    _global(r, module, _text(r, r.line(), "ascii"))


def _stack_global(r: BoundedReader) -> None:
    name, module = r.pop(), r.pop()
    _global(r, module, name)


def _float_line(r: BoundedReader) -> float:
    """Protocol 0's FLOAT, as `repr` writes it; Python refuses one past the float range."""
    text = r.text_number(FLOAT, "a text float")
    value = float(text)
    if value in (float("inf"), float("-inf")) and not text.endswith(b"inf"):
        raise Malformed("a text float past the float range (Python refuses it)")
    return value


def _int_line(r: BoundedReader) -> int:
    """Protocol 0's INT, where "00" and "01" are False and True (as to Python)."""
    flag = {b"01\n": True, b"00\n": False}.get(r.data[r.pos : r.pos + 3])
    if flag is not None:
        r.pos += 3
        return flag
    return int(r.text_number(DECIMAL, "a text integer"))


def _long_line(r: BoundedReader) -> int:
    """Protocol 0's LONG: Python drops one trailing L (which it writes), if there is one."""
    return int(r.text_number(LONG, "a text integer").removesuffix(b"L"))


def _bytearray(r: BoundedReader) -> bytearray:
    raw = r.length(8, "a bytearray")
    r.spend(ALLOC["object"] + len(raw))
    return bytearray(raw)


def _memo_index(r: BoundedReader) -> int:
    return int(r.text_number(MEMO_INDEX, "a memo index"))


def _mark(r: BoundedReader) -> None:
    r.mark()


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
    _new_tuple(r, r.pop_mark())


def _empty(make: Callable[[], object], cost: int) -> Callable[[BoundedReader], None]:
    """EMPTY_LIST, EMPTY_DICT, EMPTY_SET, EMPTY_TUPLE: a container, charged with its record."""

    def empty(r: BoundedReader) -> None:
        r.spend(cost)
        r.push(r.made(make()))

    return empty


OBJECT, NUMBER = ALLOC["object"], ALLOC["number"]
OPCODES: dict[int, Callable[[BoundedReader], None]] = {
    ord(k): v
    for k, v in {
        ".": _stop,
        "\x80": _proto,
        "\x95": _frame,
        "(": _mark,
        "0": _pop,
        "1": lambda r: r.pop_mark(),
        "2": _dup,
        "N": _push(lambda r: None),
        "\x88": _push(lambda r: True),
        "\x89": _push(lambda r: False),
        "I": _push(_int_line, NUMBER),
        "L": _push(_long_line, NUMBER),
        "J": _push(_i4, NUMBER),
        "K": _push(_u1, NUMBER),
        "M": _push(_u2, NUMBER),
        "\x8a": lambda r: _long(r, 1),
        "\x8b": lambda r: _long(r, 4),
        "F": _push(_float_line, NUMBER),
        "G": _push(lambda r: r.number(">d", "a float"), NUMBER),
        "T": _push(lambda r: _text(r, r.length(4, "a string"), "ascii")),
        "U": _push(lambda r: _text(r, r.length(1, "a string"), "ascii")),
        "B": _push(lambda r: r.length(4, "bytes")),
        "C": _push(lambda r: r.length(1, "bytes")),
        "\x8e": _push(lambda r: r.length(8, "bytes")),
        "\x96": _push(_bytearray),
        "V": _push(lambda r: _text(r, r.line(), "raw-unicode-escape")),
        "X": _push(lambda r: _text(r, r.length(4, "text"))),
        "\x8c": _push(lambda r: _text(r, r.length(1, "text"))),
        "\x8d": _push(lambda r: _text(r, r.length(8, "text"))),
        "]": _empty(list, OBJECT),
        ")": _empty(tuple, OBJECT),
        "}": _empty(dict, OBJECT),
        "\x8f": _empty(set, ALLOC["set"]),
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
        "p": lambda r: _put(r, _memo_index(r)),
        "q": lambda r: _put(r, _u1(r)),
        "r": lambda r: _put(r, _u4(r)),
        "\x94": lambda r: _put(r, len(r.memo)),
        "g": lambda r: _get(r, _memo_index(r)),
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
