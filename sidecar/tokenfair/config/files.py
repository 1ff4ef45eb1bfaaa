"""Opening the files a user names (config, tenants, traces, records): regular files only.

A path can name anything: a FIFO nobody writes (``open`` for reading blocks until a writer
appears: the sidecar's event loop, admin port included, froze with it; a CLI hung), a device
(``/dev/zero`` through a symlink: a read that never ends, memory without bound), a directory, a
socket. Every file the project reads or appends to is opened here, and only if it is a
**regular file**:

1. ``os.stat`` first (following symlinks, as ``open`` does): anything else is refused without
   opening it (opening a device may have effects of its own);
2. then ``os.open`` with ``O_NONBLOCK`` (a FIFO swapped in after the check opens at once
   instead of blocking: for reading it opens, for writing without a reader it fails with
   ``ENXIO``) and ``fstat`` of what was opened: the file read is the file checked. The
   descriptor is then set back to blocking (which a regular file ignores either way).

A refusal is :class:`InputFileError` (a ``ValueError``: the CLI's one line and exit 2), naming
the path and what it is; an ``OSError`` (missing, no permission) passes through for the caller
to word. :func:`read_regular` also bounds the size: ``max_bytes`` checked on the size ``fstat``
reports and again on what is read (a file growing meanwhile).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO, Final

_KINDS: Final = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class InputFileError(ValueError):
    """A path that names no regular file, or one too large; the message names the path and
    the rule."""


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``a FIFO``, ``a character device``)."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return "not a regular file"


def _refuse_unless_regular(path: str | Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise InputFileError(f"{path}: must be a regular file (it is {kind_of(mode)})")


def open_regular(path: str | Path, *, append: bool = False) -> BinaryIO:
    """``path`` opened for reading (``rb``), or with ``append`` for appending (created if
    missing, unbuffered ``ab``), if it is a regular file; :class:`InputFileError` if it is
    not, ``OSError`` if it cannot be opened."""
    try:
        _refuse_unless_regular(path, os.stat(path).st_mode)
    except FileNotFoundError:
        if not append:
            raise
    flags = os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_WRONLY | os.O_APPEND | os.O_CREAT if append else os.O_RDONLY
    descriptor = os.open(path, flags, 0o666)  # the umask applies, as to open("ab")
    try:
        _refuse_unless_regular(path, os.fstat(descriptor).st_mode)
        os.set_blocking(descriptor, True)
        if append:
            return os.fdopen(descriptor, "ab", buffering=0)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_regular(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them
    (:class:`InputFileError` if it is larger, or no regular file; ``OSError`` if it cannot be
    read)."""
    with open_regular(path) as handle:
        if os.fstat(handle.fileno()).st_size > max_bytes:
            raise InputFileError(_too_large(path, max_bytes))
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputFileError(_too_large(path, max_bytes))
    return data


def _too_large(path: str | Path, max_bytes: int) -> str:
    return f"{path}: must be at most {max_bytes} bytes ({max_bytes / 1048576:g} MiB)"
