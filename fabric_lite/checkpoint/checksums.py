"""Checksums of checkpoint files: CRC-32 over a stream as it is written (any store), or, for files torch's own
writer wrote to a local disk, a digest of the zip directory's per-record CRC-32s ("zip:" values); both are
checked on load on a helper thread while torch.load reads."""

from __future__ import annotations

import hashlib
import io
import os
import struct
import threading
import zlib
from typing import Any, List, Optional, Tuple

__all__ = ["CHECKSUM", "ZIP_PREFIX", "ZIP_DAMAGED", "CHUNK", "matches", "digest", "on_helper_thread", "HashingWriter", "is_local",
           "zip_listing_digest", "zip_digest", "checksum_of", "digest_file"]

#: A checksum that starts with this is a digest of the file's zip directory (each record's CRC-32, which torch's
#: writer computes as it writes), checked together with every record's bytes; others are over the whole file.
ZIP_PREFIX = "zip:"
#: What `zip_digest` gives for a file that is not a whole zip: it matches no manifest entry, even one that says it.
ZIP_DAMAGED = f"{ZIP_PREFIX}damaged"
CHUNK = 8 * 2**20


def _error(message: str) -> Exception:
    from fabric_lite.checkpoint.files import CheckpointError

    return CheckpointError(message)


_POOL: Any = None
#: The checksum new checkpoints record. CRC-32 catches torn and corrupted files (what it is for:
#: untrusted content is handled by `weights_only=True` loading) at ~3.7 GB/s, against ~1.7 GB/s for
#: SHA-256, which made saving a large checkpoint half as fast as a bare torch.save. Manifests name
#: their algorithm; "sha256" ones still verify.
CHECKSUM = "crc32"


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)  # releases the GIL on large buffers

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def digest(algorithm: str) -> Any:
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise _error(f"Unknown checksum {algorithm!r} in a manifest; this fabric_lite knows crc32 and sha256.")


def on_helper_thread(fn: Any, *args: Any) -> Any:
    """Run `fn(*args)` on the checksum thread (a Future); in place once the interpreter is shutting down, when
    no new work is accepted but a background save still finishes."""
    try:
        return _pool().submit(fn, *args)
    except RuntimeError:
        from concurrent.futures import Future

        done: Any = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as err:
            done.set_exception(err)
        return done


def _pool() -> Any:
    global _POOL
    # A forked child (notebook_launcher, dataloader workers) inherits the pool but not its thread:
    # work given to it would wait for ever, so each process makes its own.
    if _POOL is None or _POOL[0] != os.getpid():
        from concurrent.futures import ThreadPoolExecutor

        _POOL = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="fabric_lite_checksum"))
    return _POOL[1]


class HashingWriter(io.RawIOBase):
    """A file-like `torch.save` writes into: bytes go to `f` and into a checksum at the same time.

    Large chunks are hashed on a helper thread while this one writes them (both release the GIL),
    so the checksum costs little beyond the write itself."""

    _PARALLEL = 1 << 20

    def __init__(self, f: Any) -> None:
        super().__init__()
        self.f = f
        self.digest = digest(CHECKSUM)
        #: The first error the file gave (torch.save reports a failed write as its own RuntimeError).
        self.error: Optional[OSError] = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        try:
            if view.nbytes >= self._PARALLEL:
                pending = on_helper_thread(self.digest.update, view)
                try:
                    self.f.write(view)
                finally:
                    pending.result()  # before returning: the caller may reuse the buffer
            else:
                self.digest.update(view)
                self.f.write(view)
        except OSError as err:
            self.error = self.error or err
            raise
        return view.nbytes

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as err:
            self.error = self.error or err
            raise

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"file", "local"} & set(protocol))


def _structure_digest(archive: Any, f: Any) -> str:
    """CRC-32 over everything in a zip but the records' bytes (which their own CRC-32s cover): every local
    header with its name and padding, and the central directory to the end of the file. Reads a few KB."""
    value = 0
    for info in archive.infolist():
        f.seek(info.header_offset)
        fixed = f.read(30)
        if len(fixed) < 30:
            raise EOFError("a local header is cut short")
        name_length, extra_length = struct.unpack("<HH", fixed[26:30])
        value = zlib.crc32(fixed + f.read(name_length + extra_length), value)
        value = zlib.crc32(f"{info.CRC:08x}:{info.file_size}".encode(), value)
    f.seek(archive.start_dir)
    value = zlib.crc32(f.read(), value)
    return f"{ZIP_PREFIX}{value:08x}"


def zip_listing_digest(path: str) -> str:
    """The manifest entry of a file torch.save wrote: a digest of its zip structure (headers, directory, each
    record's CRC-32 and size), reading only those few KB."""
    import zipfile

    with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
        return _structure_digest(archive, f)


def zip_digest(source: Any) -> str:
    """The same digest, after checking every record's bytes against its CRC-32 (what loading does): any byte
    of the file that changed shows. A file that is not a whole zip gives a value that matches nothing.

    torch's records are stored, not compressed: each is read once from where its local header says it
    starts (a local file through one reused buffer, bytes in place), the large ones on several threads
    at once (reads and zlib release the GIL)."""
    import zipfile

    f = open(source, "rb") if isinstance(source, str) else source
    try:
        with zipfile.ZipFile(f) as archive:
            _check_records(archive, f)
            return _structure_digest(archive, f)
    except Exception:  # zipfile raises many kinds for a damaged archive (bad method, flags, lengths): all say damaged
        return ZIP_DAMAGED
    finally:
        if f is not source:
            f.close()


#: Records at least this large are checked on the record threads; smaller ones in place.
_PARALLEL_RECORD = 4 * 2**20
_READ_CHUNK = 2**20
_RECORD_POOL: Any = None
_BUFFERS = threading.local()


def _check_records(archive: Any, f: Any) -> None:
    """Every record's bytes against the CRC-32 of the zip's directory (zipfile.BadZipFile where one differs)."""
    import zipfile

    whole: Optional[memoryview] = f.getbuffer() if isinstance(f, io.BytesIO) else None
    try:
        fd: Optional[int] = f.fileno() if whole is None else None
    except (OSError, io.UnsupportedOperation):
        fd = None
    try:
        large = []
        for info in archive.infolist():
            if (whole is None and fd is None) or info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
                with archive.open(info) as member:  # zipfile compares the CRC-32 once a record is read whole
                    while member.read(CHUNK):
                        pass
                continue
            if info.compress_size != info.file_size:
                raise zipfile.BadZipFile(f"a stored record's sizes differ: {info.filename}")
            job = (whole, fd, _record_start(whole, fd, info), info.compress_size)
            if info.compress_size >= _PARALLEL_RECORD:
                large.append((job, info))
            elif _record_crc(job) != info.CRC:
                raise zipfile.BadZipFile(f"bad CRC-32 for {info.filename}")
        for crc, (_, info) in zip(_record_crcs([job for job, _ in large]), large):
            if crc != info.CRC:
                raise zipfile.BadZipFile(f"bad CRC-32 for {info.filename}")
    finally:
        if whole is not None:
            whole.release()


def _read_at(whole: Optional[memoryview], fd: Optional[int], offset: int, size: int) -> bytes:
    if whole is not None:
        return bytes(whole[offset:offset + size])
    assert fd is not None
    return os.pread(fd, size, offset)


def _record_start(whole: Optional[memoryview], fd: Optional[int], info: Any) -> int:
    """Where a record's bytes start, from its local header (checked as zipfile checks it)."""
    import zipfile

    header = _read_at(whole, fd, info.header_offset, 30)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile("bad local header")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    name = _read_at(whole, fd, info.header_offset + 30, name_length)
    if name != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
        raise zipfile.BadZipFile("a local header names another record")
    return int(info.header_offset + 30 + name_length + extra_length)


def _record_crc(job: Tuple[Optional[memoryview], Optional[int], int, int]) -> int:
    """The CRC-32 of `size` bytes at `start` (EOFError where the file ends first)."""
    whole, fd, start, size = job
    if whole is not None:
        data = whole[start:start + size]
        if data.nbytes != size:
            raise EOFError("a record is cut short")
        return zlib.crc32(data)
    assert fd is not None
    buffer = getattr(_BUFFERS, "buffer", None)
    if buffer is None:  # one per thread, reused: fresh memory for every read costs more than the read
        buffer = _BUFFERS.buffer = memoryview(bytearray(_READ_CHUNK))
    value, done = 0, 0
    while done < size:
        n = os.preadv(fd, [buffer[:min(_READ_CHUNK, size - done)]], start + done)
        if n <= 0:
            raise EOFError("a record is cut short")
        value = zlib.crc32(buffer[:n], value)
        done += n
    return value


def _record_crcs(jobs: List[Any]) -> List[int]:
    """The CRC-32 of each large record, on several threads at once."""
    if len(jobs) < 2:
        return [_record_crc(job) for job in jobs]
    try:
        return list(_record_pool().map(_record_crc, jobs))
    except RuntimeError:  # the interpreter is shutting down: in place
        return [_record_crc(job) for job in jobs]


def _record_pool() -> Any:
    global _RECORD_POOL
    if _RECORD_POOL is None or _RECORD_POOL[0] != os.getpid():  # (one per process, as `_pool`)
        from concurrent.futures import ThreadPoolExecutor

        threads = max(2, min(4, os.cpu_count() or 1))
        _RECORD_POOL = (os.getpid(), ThreadPoolExecutor(threads, thread_name_prefix="fabric_lite_crc"))
    return _RECORD_POOL[1]


def matches(found: str, expected: str) -> bool:
    """Whether a computed checksum is the manifest's (a damaged zip matches nothing)."""
    return found == expected and found != ZIP_DAMAGED


def checksum_of(source: Any, expected: str, algorithm: str) -> str:
    """`source` (a local path or bytes) checksummed the way `expected` was made."""
    if expected.startswith(ZIP_PREFIX):
        return zip_digest(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
    if isinstance(source, (bytes, bytearray)):
        value = digest(algorithm)
        value.update(source)
        return value.hexdigest()
    return digest_file(source, algorithm)


def digest_file(path: str, algorithm: str) -> str:
    value = digest(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            value.update(chunk)
    return value.hexdigest()
