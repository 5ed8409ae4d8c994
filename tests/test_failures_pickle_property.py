"""Issue 59: the pickle reader reads exactly what Python reads, or refuses.

12,000 files from a fixed seed: random objects of Python's own types pickled by Python at
every protocol (0-5), and one mutation of each (bytes flipped, inserted, dropped, cut,
opcodes swapped, protocol-0 numbers rewritten: `I010`, `I+1`, `L5LL`, `F1_0`, ...). Each
is read by cognet's reader (`BoundedReader`, every global refused) and by Python's C
unpickler whose `find_class` refuses every global (its import fails), in one child process
under an address-space and CPU limit. Every file is either refused by the reader (`Refused` or
`Malformed`: exit 2 in `cognet data benchmark`) or read to what Python reads: the same
types, values (floats by their bits) and sharing of mutable containers.
"""

from __future__ import annotations

import math
import pickle
import random
import struct
import subprocess
import sys
import textwrap

from cognet.data.pickle_bounds import Malformed, Refused
from cognet.data.pickle_reader import BoundedReader

SEED = 59
OBJECTS = 1000  # each pickled at 6 protocols, each file also mutated once: 12,000 files
ORACLE_MEMORY = 1 << 30  # the child's address space beyond its own at start

# Python's C unpickler, every global refused; results framed as (length, verdict + bytes).
# `pickle.loads` reads from memory: an Unpickler over io.BytesIO reads through readinto,
# which fails on a bytearray inside a frame (a CPython bug: MemoryError, then SystemError),
# so its find_class refuses every global by the import it starts with.
ORACLE = textwrap.dedent("""
    import builtins, pickle, resource, struct, sys

    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    limit = size + int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CPU, (300, 300))


    def no_import(name, *args, **kwargs):
        raise ImportError(f"no globals: {name}")


    data, out = sys.stdin.buffer.read(), sys.stdout.buffer
    builtins.__import__ = no_import
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        case, pos = data[pos + 4 : pos + 4 + n], pos + 4 + n
        try:
            result = b"V" + pickle.dumps(pickle.loads(case), protocol=5)
        except Exception:  # an error, MemoryError and RecursionError included: not read
            result = b"E"
        out.write(struct.pack("<I", len(result)) + result)
        out.flush()
""")


# -- random objects, pickled by Python ------------------------------------------------------


def random_atom(rng: random.Random) -> object:
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind <= 3:  # integers of every size Python writes differently, and some beyond 8 bytes
        bits = rng.choice([1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100])
        return rng.randrange(-(1 << bits), 1 << bits)
    if kind == 4:
        special = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e300, 5e-324, 0.1]
        return rng.choice(special + [rng.uniform(-1e6, 1e6)])
    if kind <= 7:
        alphabet = rng.choice(["abc019", "é\x00\n\\ ", "\u202e€\U0001f600", "\ud800x"])
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(6)))
    if kind <= 9:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(5)))
    if kind == 10:
        return bytearray(b"ab"[: rng.randrange(3)])
    return rng.randrange(1000)


def random_key(rng: random.Random) -> object:
    options = [rng.randrange(-300, 70000), f"k{rng.randrange(50)}", b"b", (1, "t"), None, 1.5]
    return rng.choice(options[:3] * 6 + options[3:])


def random_object(rng: random.Random, pool: list, depth: int = 0) -> object:
    """An atom or a container of at most 5 items, 4 deep at most; some parts shared (the same
    object reused from `pool`) and a few lists holding themselves."""
    if pool and rng.random() < 0.08:
        return rng.choice(pool)
    if depth >= 4 or rng.random() < 0.45:
        return random_atom(rng)
    n = rng.randrange(6)
    kind = rng.randrange(6)
    items = [random_object(rng, pool, depth + 1) for _ in range(n)]
    if kind <= 1:
        made: object = items
        if rng.random() < 0.03:
            items.append(items)
    elif kind == 2:
        made = tuple(items)
    elif kind == 3:
        made = {random_key(rng): item for item in items}
    else:
        keys = {random_key(rng) for _ in range(n)}
        made = set(keys) if kind == 4 else frozenset(keys)
    pool.append(made)
    return made


# -- mutations --------------------------------------------------------------------------------

NUMBER_FORMS = [b"010", b"00", b"01", b"-0", b"+1", b" 5", b"1_0", b"0x1f", b"0o7", b"5L", b"5LL"]
NUMBER_FORMS += [b"1e999", b"1_0.5", b" 1.5", b"inf", b"nan", b"-nan", b"99999999999999999999"]
NUMBER_FORMS += [b"1\x00x", b"7\r", b"", b"L", b"00000000000000000000000001"]
OPCODES = b"().0123NIJKLMFGTUBCVXabcdeghjlpqrstu}]\x80\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d"
OPCODES += b"\x8e\x8f\x90\x91\x94\x95\x96"


def mutate(rng: random.Random, data: bytes) -> bytes:
    n = len(data)
    at = rng.randrange(n)
    kind = rng.randrange(8)
    if kind == 0:
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
    if kind == 1:
        return data[:at] + bytes([rng.choice(OPCODES)]) + data[at:]
    if kind == 2:
        return data[:at] + data[at + 1 :]
    if kind == 3:
        return data[:at]
    if kind == 4:
        end = min(n, at + rng.randrange(1, 12))
        return data[:end] + data[at:end] + data[end:]
    if kind == 5:
        return data[:at] + bytes([rng.choice(OPCODES)]) + data[at + 1 :]
    # a protocol-0 number or memo index rewritten (where the file has none: a byte flipped)
    lines = [i for i in range(n - 1) if data[i] in b"ILFpg" and b"\n" in data[i + 1 : i + 24]]
    if not lines:
        return data[:at] + bytes([data[at] ^ 1 << rng.randrange(8)]) + data[at + 1 :]
    start = rng.choice(lines) + 1
    end = data.index(b"\n", start)
    return data[:start] + rng.choice(NUMBER_FORMS) + data[end:]


def cases() -> list[bytes]:
    rng = random.Random(SEED)
    made = []
    for _ in range(OBJECTS):
        value = random_object(rng, [])
        for protocol in range(6):
            data = pickle.dumps(value, protocol=protocol)
            made += [data, mutate(rng, data)]
    return made


# -- the comparison ---------------------------------------------------------------------------


def same(ours: object, theirs: object, seen: dict) -> bool:
    """Equal types and values (floats by bits), and the same sharing of mutable containers:
    one of ours always meets one of theirs, and no two of ours meet the same one."""
    if type(ours) is not type(theirs):
        return False
    if isinstance(ours, float):
        return struct.pack("<d", ours) == struct.pack("<d", theirs)
    if isinstance(ours, (list, dict, set, bytearray)):
        if id(ours) in seen:
            return seen[id(ours)] is theirs
        if any(other is theirs for other in seen.values()):
            return False
        seen[id(ours)] = theirs
    if isinstance(ours, (list, tuple)):
        return len(ours) == len(theirs) and all(
            same(a, b, seen) for a, b in zip(ours, theirs, strict=True)
        )
    if isinstance(ours, dict):
        keys_alike = same(list(ours), list(theirs), {})
        return keys_alike and all(same(ours[k], theirs[k], seen) for k in ours)
    if isinstance(ours, (set, frozenset)):  # members are strings, bytes and small integers
        return {(type(x), x) for x in ours} == {(type(x), x) for x in theirs}
    return ours == theirs


def oracle(files: list[bytes]) -> list[bytes]:
    """Python's verdict on each file: b"E" (an error) or b"V" + the value, re-pickled."""
    batch = b"".join(struct.pack("<I", len(f)) + f for f in files)
    done = subprocess.run(
        [sys.executable, "-c", ORACLE, str(ORACLE_MEMORY)], input=batch, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    results, pos, out = [], 0, done.stdout
    while pos < len(out):
        (n,) = struct.unpack_from("<I", out, pos)
        results.append(out[pos + 4 : pos + 4 + n])
        pos += 4 + n
    assert len(results) == len(files)
    return results


def test_every_file_is_read_as_python_reads_it_or_refused():
    files = cases()
    assert len(files) >= 10_000
    verdicts = oracle(files)
    read = 0
    for data, verdict in zip(files, verdicts, strict=True):
        try:
            ours = BoundedReader(data).load()
        except (Refused, Malformed):
            continue
        read += 1
        assert verdict[:1] == b"V", f"read, but Python refuses it: {data!r}"
        assert same(ours, pickle.loads(verdict[1:]), {}), f"read otherwise than Python: {data!r}"
    # both sides exercised (by this seed: 3,856 read; the valid files Python reads, 88%)
    assert len(files) // 4 < read < len(files) * 3 // 4, read
