"""The checkpoint-writer processes (``checkpoint/writer.py``): a file hashed as written (its
sidecar digest is the file's SHA-256; a seek or a size mismatch means no digest), and a forked
writer and its own forked worker ignore the preemption signals and die with the rank."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from megatron_stare.checkpoint.writer import HASH_SUFFIX, HashingFile, written_sha256

ROOT = Path(__file__).resolve().parents[2]


def test_hashing_file_digest_is_the_files_sha256(tmp_path):
    path = tmp_path / "__0_0.distcp"
    with HashingFile(open(path, "wb"), str(path)) as f:
        f.write(b"abc" * 1000)
        f.write(memoryview(bytearray(range(256))))
        f.tell(), f.flush(), os.fsync(f.fileno())
    assert written_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    path.write_bytes(path.read_bytes()[:-1])  # cut short: the digest no longer applies
    assert written_sha256(path) is None

    other = tmp_path / "seeked"
    with HashingFile(open(other, "wb"), str(other)) as f:
        f.write(b"xyz")
        f.seek(0)
        f.write(b"a")
    assert not Path(str(other) + HASH_SUFFIX).exists() and written_sha256(other) is None


_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, sys, time
    from megatron_stare.checkpoint import writer as cw

    os.register_at_fork(before=cw._remember_parent)

    def worker():
        cw.die_with_parent()
        open(os.path.join(sys.argv[1], "worker"), "w").write(str(os.getpid()))
        time.sleep(60)

    def writer():
        cw.die_with_parent()
        p = mp.get_context("fork").Process(target=worker)
        p.start()
        open(os.path.join(sys.argv[1], "writer"), "w").write(str(os.getpid()))
        time.sleep(60)

    mp.get_context("fork").Process(target=writer).start()
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_writers_ignore_preemption_signals_and_die_with_their_rank(tmp_path):
    rank = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(tmp_path)], cwd=ROOT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / role).is_file() and (tmp_path / role).read_text() for role in ("writer", "worker")):
            assert rank.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        pids = {role: int((tmp_path / role).read_text()) for role in ("writer", "worker")}
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)  # torchrun's preemption signal reaches the rank's group
        time.sleep(0.5)
        assert all(_alive(pid) for pid in pids.values())
        rank.kill()  # SIGKILL: no atexit, no finalizer runs in the rank
        rank.wait()
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [role for role, pid in pids.items() if _alive(pid)], "a writer outlived its rank"
    finally:
        try:  # whatever is left of the group (the writers keep the rank's process group)
            os.killpg(rank.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        rank.wait()
