"""Issue 59, outputs that are no regular file (`make failures`): a full disk, a device, a
FIFO or a socket, the null device, and `--out` forms that name no file.

A full disk exits 1 with one line naming the path, and leaves no lock file and no partial
file; an output naming a device, FIFO or socket is refused before any work (exit 2) and
stays what it was; /dev/null is written in place (exit 0), its node untouched (never
replaced: the tests only check it is still the same character device).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pickle_ops import ddi_matrix, ddi_stream, voc_stream

from cognet.cli import main as cognet_main
from cognet.core import lock
from cognet.core.errors import OutputError
from cognet.export.cli import main as export_main
from cognet.runtime import writer
from cognet.runtime.cli import main as batch_main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def inp(visits, tmp_path) -> Path:
    path = tmp_path / "in.parquet"
    pq.write_table(visits, path)
    return path


def error(result, code: int = 2) -> str:
    """The one line of a failed command (no traceback)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def score_argv(tiny: Path, inp: Path, out: str, *extra: str) -> list[str]:
    return ["score", str(inp), "--model", str(tiny / "model"), "--out", out, "--quiet", *extra]


# -- --out forms that name no file ------------------------------------------------------------
NO_NAME = [".", "./", "", "/"]


@pytest.mark.parametrize("form", NO_NAME, ids=["dot", "dot-slash", "empty", "root"])
def test_an_out_that_names_no_file_is_a_usage_error(tiny, inp, form, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # '.' is this empty folder: nothing there to replace
    ckpt = str(tiny / "ckpt")
    runs = {
        "data synth": (cognet_main, ["data", "synth", "--out", form, "--patients", "10"]),
        "cognet-export": (export_main, ["--checkpoint", ckpt, "--out", form, "--no-validate"]),
        "ensemble": (
            cognet_main,
            ["ensemble", ckpt, ckpt, "--data", str(tiny / "data"), "--out", form],
        ),
        "score": (batch_main, score_argv(tiny, inp, form)),
    }
    for name, (main, argv) in runs.items():
        line = error(CliRunner().invoke(main, argv))
        assert "Error: --out '" in line and "': names no file or folder" in line, (name, line)
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]  # nothing written, no lock file


# -- devices, FIFOs and sockets -----------------------------------------------------------------
@contextlib.contextmanager
def special_files(folder: Path):
    """A FIFO and a listening Unix socket in `folder`: {kind: path}."""
    fifo, sock_path = folder / "fifo", folder / "sock"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        yield {"FIFO": fifo, "socket": sock_path}
    finally:
        sock.close()


def test_an_output_that_is_a_fifo_or_socket_is_refused_before_work(tiny, inp, tmp_path):
    out = tmp_path / "o.parquet"
    with special_files(tmp_path) as nodes:
        for kind, node in nodes.items():
            before = os.stat(node)
            runs = {
                "score --out": score_argv(tiny, inp, str(node)),
                "score --summary-json": score_argv(
                    tiny, inp, str(out), "--summary-json", str(node)
                ),
            }
            for name, argv in runs.items():
                line = error(CliRunner().invoke(batch_main, argv))
                assert f"{node}: " in line and f"is a {kind}" in line, (name, line)
            evaluate = [
                "evaluate",
                "--checkpoint",
                str(tiny / "ckpt"),
                "--data",
                str(tiny / "data"),
                "--rounds",
                "1",
                "--quiet",
            ]
            for option in ("--json", "--predictions"):
                line = error(CliRunner().invoke(cognet_main, [*evaluate, option, str(node)]))
                assert f"is a {kind}" in line, (option, line)
            after = os.stat(node)
            assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
            assert not out.exists() and not writer.work_dir(out).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".lock")]


@pytest.fixture
def null(tmp_path) -> Path:
    """A null device node of our own in tmp_path (the same device as /dev/null): the tests
    never write to the machine's /dev/null, so code that would rename over it (an older
    cognet) replaces only this node. Skipped where device nodes cannot be made."""
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.stat(os.devnull).st_rdev)
        node.write_bytes(b"x")  # a nodev mount refuses this
    except OSError:
        pytest.skip("cannot make a device node here")
    return node


def node_of(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    assert stat.S_ISCHR(st.st_mode)  # still the character device
    return st.st_mode, st.st_rdev, st.st_ino


def test_the_null_device_is_written_in_place(tiny, inp, tmp_path, null):
    before = node_of(null)
    out = tmp_path / "o.parquet"
    argv = score_argv(tiny, inp, str(out), "--summary-json", str(null))
    result = CliRunner().invoke(batch_main, argv)
    assert result.exit_code == 0, result.output
    assert out.is_file() and node_of(null) == before
    evaluate = ["evaluate", "--checkpoint", str(tiny / "ckpt"), "--data", str(tiny / "data")]
    result = CliRunner().invoke(cognet_main, [*evaluate, "--rounds", "1", "--json", str(null)])
    assert result.exit_code == 0, result.output
    assert node_of(null) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".null")]  # no lock
    # OUT's rejects file and work folder would go beside it (into /dev): refused before work
    line = error(CliRunner().invoke(batch_main, score_argv(tiny, inp, str(null))))
    assert f"{null}: --out is the null device" in line
    assert node_of(null) == before and not Path(f"{null}.parts").exists()
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)  # the machine's, never named here


# -- a full disk -------------------------------------------------------------------------------
def on_full_disk(disk: Path, command: str) -> subprocess.CompletedProcess:
    """Run `command` with a 64 KB tmpfs at `disk` filled to the last byte (own mount
    namespace: `unshare`); stdout: what is left on the disk besides the filler."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rm is not allowed here")
    disk.mkdir()
    fill = f"mount -t tmpfs -o size=64k tmpfs {disk} && (cat /dev/zero > {disk}/fill 2>/dev/null"
    script = f"{fill}; true) && {{ {command}; rc=$?; ls -A {disk} | grep -vx fill; exit $rc; }}"
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, cwd=REPO
    )


def full_disk_line(done: subprocess.CompletedProcess, path: Path) -> str:
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0] == f"Error: {path}: no space left on device", lines
    assert done.stdout.strip() == "", done.stdout  # no lock file, no partial file
    return lines[0]


def cli(module: str, *argv: str) -> str:
    return " ".join([sys.executable, "-c", f"'from {module} import main; main()'", *map(str, argv)])


def test_a_full_disk_under_score_out(tiny, inp, tmp_path):
    disk = tmp_path / "disk"
    command = cli("cognet.runtime.cli", *score_argv(tiny, inp, f"{disk}/o.parquet"))
    full_disk_line(on_full_disk(disk, command), disk / "o.parquet")


def test_a_full_disk_under_summary_json(tiny, inp, tmp_path):
    disk = tmp_path / "disk"
    out = tmp_path / "o.parquet"
    argv = score_argv(tiny, inp, str(out), "--summary-json", f"{disk}/s.json")
    full_disk_line(on_full_disk(disk, cli("cognet.runtime.cli", *argv)), disk / "s.json")
    assert not list(tmp_path.glob(".o.parquet*.lock"))  # the other outputs' locks went too


def test_a_full_disk_under_data_benchmark(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    records = [[[[0, 1], [0], [0, 1]]], [[[1], [1], [2]]], [[[2], [0], [3]]]]
    (files / "r.pkl").write_bytes(pickle.dumps(records, protocol=4))
    (files / "v.pkl").write_bytes(voc_stream())
    (files / "d.pkl").write_bytes(ddi_stream(ddi_matrix()))
    disk = tmp_path / "disk"
    argv = ["data", "benchmark", "--records", files / "r.pkl", "--voc", files / "v.pkl"]
    command = cli("cognet.cli", *argv, "--ddi", files / "d.pkl", "--out", disk / "data")
    full_disk_line(on_full_disk(disk, command), disk / "data")


def test_a_lock_that_cannot_be_signed_is_let_go(tmp_path, monkeypatch):
    """The lock file is made (an inode) but its `PID HOST COMMAND` cannot be written."""
    out = tmp_path / "o.parquet"

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lock.os, "write", full)
    with pytest.raises(OutputError, match=f"^{out}: no space left on device$"):
        with lock.claim(out, "cognet test"):
            pass
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    with lock.claim(out, "cognet test"):  # and the next run locks as usual
        assert lock.lock_file(out).exists()
    shutil.rmtree(tmp_path)
