"""Failure behaviour of `cognet data benchmark` on hostile and odd pickles (issue 48): files
of today's dill read; nesting, claimed lengths, shared references, integers and keys bounded
by construction; codes checked by form; error lines escaped. Every stream is made here, by
hand (`pickle_ops`) or by the real dill in a subprocess; no benchmark data."""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from pickle_ops import (
    DIAG,
    MEDS,
    NONE,
    PROC,
    ddi_matrix,
    ddi_stream,
    op_build,
    op_call,
    op_dict,
    op_dill,
    op_function,
    op_global,
    op_int,
    op_str,
    op_tuple,
    op_voc,
    op_voc_class,
    stream,
    voc_stream,
)

from cognet.cli.data import data

RECORDS = [[[[0, 1], [0], [0, 1]], [[2], [1], [1, 2, 3]]], [[[1], [], [2]]], [[[0], [1], [3]]]]
ROOT = Path(__file__).resolve().parents[1]


def write_files(folder: Path, records: bytes | None = None, voc=None, ddi=None) -> dict:
    paths = {name: folder / f"{name}_final.pkl" for name in ("records", "voc", "ddi_A")}
    paths["records"].write_bytes(records or pickle.dumps(RECORDS, protocol=4))
    paths["voc"].write_bytes(voc or voc_stream())
    paths["ddi_A"].write_bytes(ddi or ddi_stream(ddi_matrix()))
    return paths


def convert(paths: dict, out: Path):
    args = ["benchmark", "--records", str(paths["records"]), "--voc", str(paths["voc"])]
    return CliRunner().invoke(data, [*args, "--ddi", str(paths["ddi_A"]), "--out", str(out)])


def assert_refused(result, out: Path, *texts: str) -> None:
    """Exit 2, one line naming the problem, no traceback, nothing written."""
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    for text in texts:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.output and not out.exists()


def refused(tmp_path: Path, slot: str, body: bytes, *texts: str) -> str:
    """Convert with one file replaced by `body`; assert the refusal names that file."""
    paths = write_files(tmp_path, **{"ddi" if slot == "ddi_A" else slot: body})
    result = convert(paths, tmp_path / "out")
    assert_refused(result, tmp_path / "out", f"{paths[slot]}: ", *texts)
    return result.stderr


def in_subprocess(tmp_path: Path, body: bytes, memory_mib: int = 256) -> str:
    """`load` of `body` in a child whose address space may grow by `memory_mib` at most."""
    path = tmp_path / "file.pkl"
    path.write_bytes(body)
    code = textwrap.dedent(f"""
        import resource
        from cognet.core.errors import InputError
        from cognet.data.pickles import load
        size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        limit = size + {memory_mib} * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            load({str(path)!r})
        except InputError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stderr == "", (done.returncode, done.stderr[-500:])
    return done.stdout


# -- 1. files of today's dill -------------------------------------------------------------------

DILL_WRITER = '''
import sys
import dill


class Voc(object):
    """A vocabulary, as the field's preprocessing scripts define it in __main__."""

    def __init__(self, *, start: int = 0, name: str = "voc") -> None:
        self.idx2word = {}
        self.word2idx = {}

    def add_sentence(self, sentence: list, weight: float = 1.0) -> None:
        for word in sentence:
            if word not in self.word2idx:
                self.idx2word[len(self.word2idx)] = word
                self.word2idx[word] = len(self.word2idx)


vocs = {"diag_voc": Voc(), "med_voc": Voc(), "pro_voc": Voc()}
for name, words in (("diag_voc", %r), ("pro_voc", %r), ("med_voc", %r)):
    vocs[name].add_sentence(words)
with open(sys.argv[1], "wb") as f:
    dill.dump(vocs, f)
'''


def test_voc_written_by_dill_0_4_is_read(tmp_path):
    pytest.importorskip("dill")
    script = tmp_path / "processing.py"
    words = [list(v.values()) for v in (DIAG, PROC, MEDS)]
    script.write_text(DILL_WRITER % tuple(words))
    voc = tmp_path / "voc.pkl"
    subprocess.run([sys.executable, str(script), str(voc)], check=True)
    assert b"__qualname__" in voc.read_bytes()  # dill 0.4 sets it by BUILD on each function
    result = convert(write_files(tmp_path, voc=voc.read_bytes()), tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "ddi pairs 2" in result.output and "med voc 4" in result.output


def function_with_state(**state: bytes) -> bytes:
    """dill 0.4's BUILD on a function: ({}, {attribute: value})."""
    slots = op_dict(*[(op_str(k), v) for k, v in state.items()])
    return op_build(op_function("__init__"), op_tuple(op_dict(), slots))


def test_build_of_plain_attributes_on_a_function_is_read(tmp_path):
    annotations = op_dict(
        (op_str("start"), op_call(op_dill("_load_type"), op_str("int"))),
        (op_str("return"), NONE),
    )
    body = function_with_state(
        __qualname__=op_str("Voc.__init__"), __annotations__=annotations, __doc__=op_str("x")
    )
    paths = write_files(tmp_path, voc=stream(op_dict((op_str("f"), body))))
    result = convert(paths, tmp_path / "out")  # read, then refused as a vocabulary, not a file
    assert_refused(result, tmp_path / "out", "diag_voc: missing, or not a Voc")


@pytest.mark.parametrize(
    "state, text",
    [
        ({"__globals__": op_dict()}, "setting '__globals__'"),
        ({"__code__": op_str("x")}, "setting '__code__'"),
        ({"__qualname__": op_function("g")}, "setting '__qualname__' to function g"),
        ({"__annotations__": op_dict((op_str("a"), op_function("g")))}, "'__annotations__'"),
        ({"__kwdefaults__": op_dict((op_str("a"), op_function("g")))}, "'__kwdefaults__'"),
    ],
)
def test_build_on_a_function_setting_anything_else_is_refused(tmp_path, state, text):
    refused(tmp_path, "voc", stream(function_with_state(**state)), "refused: ", text)


def test_setattr_other_than_the_class_qualname_is_refused(tmp_path):
    call = op_call(op_global("builtins", "setattr"), op_voc_class(), op_str("__call__"), NONE)
    refused(tmp_path, "voc", stream(call), "builtins.setattr(class Voc, '__call__'")


# -- 2. nesting ---------------------------------------------------------------------------------


def deep_tuple(depth: int) -> bytes:
    return b")" + b"\x85" * depth  # (((),),) ... by TUPLE1


def test_key_nested_a_million_deep_is_refused_without_a_crash(tmp_path):
    """Hashing it recursed in C until SIGSEGV; the depth is refused as it is read."""
    body = b"\x80\x04}" + deep_tuple(1_000_000) + b"K\x01s."
    assert "nesting deeper than 32" in in_subprocess(tmp_path, body)


def deep_list(depth: int) -> bytes:
    """[[[...]]] `depth` deep, from the inside out: each level the list of the one before."""
    return b"]q\x00" + b"(h\x00lq\x00" * depth  # memo 0 holds the deepest so far


@pytest.mark.parametrize("where", ["records", "voc"])
def test_list_nested_deep_as_an_id_is_refused(tmp_path, where):
    """As an id, its repr recursed: RecursionError, exit 1."""
    if where == "records":
        body = b"\x80\x04]]](" + deep_list(200_000) + b"]]eaa."  # patient 0, visit 0
    else:
        body = b"\x80\x04}" + op_str("diag_voc") + deep_list(200_000) + b"s."
    refused(tmp_path, where, body, "nesting deeper than 32", "byte ")


# -- 3. memory a file's length does not bound --------------------------------------------------


def test_claimed_length_is_checked_before_anything_is_allocated(tmp_path):
    """12 bytes claiming a 4 GiB BYTEARRAY8: Python's unpicklers zero-fill it first."""
    body = b"\x80\x05\x96" + struct.pack("<Q", 4 << 30) + b"."
    line = in_subprocess(tmp_path, body, memory_mib=64)
    assert "claims 4,294,967,296 bytes; 1 are left in the file" in line


@pytest.mark.parametrize("opcode", [b"\x8e", b"\x8d", b"B", b"X"])  # BINBYTES8, ..., BINUNICODE
def test_every_claimed_length_is_checked(tmp_path, opcode):
    size = "<Q" if opcode in (b"\x8e", b"\x8d") else "<I"
    body = b"\x80\x04" + opcode + struct.pack(size, 1 << 31) + b"."
    refused(tmp_path, "records", body, "claims 2,147,483,648 bytes; 1 are left in the file")


def test_frame_claim_past_the_end_is_refused(tmp_path):
    body = b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N."
    refused(tmp_path, "records", body, "not a readable pickle (a frame claims")


def shared_records(width: int) -> bytes:
    """width x width visits in about 4 * width bytes: one visit (memo 1) in one patient
    (memo 0), each reused width times by GET."""
    visit = b"]q\x01(]K\x00a]K\x00a]K\x00ae"  # [[0], [0], [0]]
    patient = b"]q\x00(" + visit + b"h\x01" * (width - 1) + b"e"
    return b"\x80\x04](" + patient + b"h\x00" * (width - 1) + b"e."


def test_shared_references_count_against_the_walk(tmp_path):
    body = shared_records(300)  # 90,000 visits from 1.2 KB: written before, exit 0
    assert len(body) < 2000
    refused(tmp_path, "records", body, "elements to walk through shared references")
    assert "shared references" in in_subprocess(tmp_path, shared_records(3000), memory_mib=64)


def test_tuples_shared_exponentially_are_refused_before_a_hash(tmp_path):
    pairs = b"".join(b"h%ch%c\x86\x940" % (i, i) for i in range(24))  # t(i+1) = (t(i), t(i))
    body = b"\x80\x04}" + op_int(0) + b"\x940" + pairs + b"h\x18K\x01s."  # {t24: 1}
    refused(tmp_path, "voc", body, "elements to walk through shared references")


def test_a_shared_argument_counts_once_per_call(tmp_path):
    """A stand-in checks its arguments: one literal tuple handed to _create_code 2,000 times
    was checked 2,000 times (time with the square of the file's size)."""
    literal = b"(" + b"K\x01" * 2000 + b"tq\x010"  # memo 1: a tuple of 2,000 literals
    calls = b"h\x00h\x01\x85R0" * 2000  # _create_code(tuple), popped
    body = b"\x80\x04" + op_dill("_create_code") + b"q\x000" + literal + calls + b"N."
    refused(tmp_path, "voc", body, "calls whose arguments hold more than")


def test_opcodes_are_counted(tmp_path, monkeypatch):
    """Each opcode makes one object at most; past MAX_OPCODES the file is refused (here 1,000
    NONEs and POPs under a cap of 500)."""
    monkeypatch.setattr("cognet.data.pickle_bounds.MAX_OPCODES", 500)
    refused(tmp_path, "records", b"\x80\x04" + b"N0" * 500 + b"N.", "more than 500 opcodes")


# -- 4. time: keys that hash alike -------------------------------------------------------------


def test_integer_keys_out_of_range_are_refused(tmp_path):
    words = op_dict(
        *[(b"\x8a\x08" + struct.pack("<q", k * (2**61 - 1)), op_str("4019")) for k in range(1, 4)]
    )
    refused(tmp_path, "voc", stream(words), "key integer out of range")


def test_keys_other_than_text_and_integers_are_refused(tmp_path):
    refused(tmp_path, "voc", stream(op_dict((op_tuple(op_int(1)), NONE))), "a key that is a tuple")


# -- 5. input errors that exited 1 -------------------------------------------------------------


def test_integer_of_thousands_of_digits_is_refused(tmp_path):
    huge = b"\x8b" + struct.pack("<I", 2100) + b"\x01" * 2100  # LONG4, ~5,000 digits
    body = b"\x80\x04]](]" + huge + b"a]]ea."
    refused(tmp_path, "records", body, "an integer of 2,100 bytes (at most 8)")


def test_word2idx_that_is_an_array_is_refused(tmp_path):
    array = ddi_stream(ddi_matrix())[2:-1]
    words = op_dict(*[(op_int(k), op_str(w)) for k, w in DIAG.items()])
    voc = op_build(
        op_voc_class() + b")\x81", op_dict((op_str("idx2word"), words), (op_str("word2idx"), array))
    )
    refused(
        tmp_path,
        "voc",
        stream(op_dict((op_str("diag_voc"), voc))),
        "word2idx is ndarray, not a dict",
    )


# -- 8. values trusted because they parse ------------------------------------------------------


def voc_stream_with(name: str, words: dict[int, str]) -> bytes:
    """voc_final.pkl's shape with one vocabulary's words replaced."""
    pieces = {"diag_voc": DIAG, "pro_voc": PROC, "med_voc": MEDS, name: words}
    vocs = [op_voc(op_voc_class() + b"p0\n", pieces["diag_voc"])]
    vocs += [op_voc(b"g0\n", pieces[n]) for n in ("pro_voc", "med_voc")]
    names = [op_str(n) for n in ("diag_voc", "pro_voc", "med_voc")]
    return stream(op_dict(*zip(names, vocs, strict=True)))


@pytest.mark.parametrize(
    "name, word, text",
    [
        ("med_voc", "hello world", "'hello world' is not an ATC code of level 3"),
        ("med_voc", "ZZZZZZZZ", "'ZZZZZZZZ' is not an ATC code"),
        ("med_voc", "N02BE", "'N02BE' is not an ATC code of level 3"),
        ("diag_voc", "40\x0019", r"'40\x0019' is not an ICD code"),
        ("pro_voc", "39\n61", r"'39\n61' is not an ICD code"),
        ("diag_voc", "4019\u202e", r"'4019\u202e' is not an ICD code"),
        ("diag_voc", "x" * 5000, "'xxxxxxxx"),
    ],
)
def test_codes_of_the_wrong_form_are_refused(tmp_path, name, word, text):
    words = {**{"diag_voc": DIAG, "pro_voc": PROC, "med_voc": MEDS}[name], 1: word}
    line = refused(tmp_path, "voc", voc_stream_with(name, words), f"{name}: id 1: ", text)
    assert len(line) < 600


def test_atc_level_4_files_are_read(tmp_path):
    meds = {k: w + "X" for k, w in MEDS.items()}
    result = convert(write_files(tmp_path, voc=voc_stream_with("med_voc", meds)), tmp_path / "o")
    assert result.exit_code == 0, result.output


def test_duplicate_id_in_a_visit_is_refused(tmp_path):
    body = pickle.dumps([[[[0, 1, 0], [0], [0]]]], protocol=4)
    refused(tmp_path, "records", body, "patient 0, visit 0, diagnoses, item 2: id 0 appears twice")


def test_bytes_after_stop_are_refused(tmp_path):
    body = pickle.dumps(RECORDS, protocol=4) + b"\x00garbage" * 12
    refused(tmp_path, "records", body, "refused: 96 bytes after STOP")


# -- 9. error lines ------------------------------------------------------------------------------


def test_escape_sequences_in_a_refused_global_are_shown_escaped(tmp_path):
    forged = "system\x1b[2K\rwrote out: ok"
    line = refused(tmp_path, "records", b"\x80\x04" + op_global("os", forged) + b".", "global os.")
    assert "\x1b" not in line and "\r" not in line and r"\x1b[2K\rwrote" in line


def test_a_file_that_is_not_a_pickle_is_not_echoed(tmp_path):
    for body in (b"password=hunter2\n" * 4, b"p" + b"9" * 5000 + b"\n."):
        line = refused(tmp_path, "voc", body, "not a readable pickle")
        assert "hunter2" not in line and "99999" not in line and len(line) < 400
