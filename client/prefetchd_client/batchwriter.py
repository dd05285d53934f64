"""Writing batch files (their layout: prefetchd_client.batchfile).

A worker fills one ``BatchBuffer`` per batch and writes it with one ``pwrite``: into a new
file, or over a *spare*, a consumed batch's file that the daemon hands back for reuse once no
client maps it (prefetchd.master.retire). Writing 9.6 MB into new tmpfs pages costs 3.4 ms
here, the kernel allocating and zeroing each 4 KiB page, then 1.2 ms more to free them when
the batch is deleted; overwriting pages a file already has costs 0.9 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import errno
import os
import stat

import numpy as np

from .batchfile import BatchLayout


class BatchBuffer:
    """A batch laid out in memory exactly as in its file, header area included.

    A worker keeps one and fills it for every batch: its pages are faulted in once, where
    writing through a fresh mapping of each new file paid a page fault per 4 KiB and then
    an unmap. Every field is overwritten by the next fill; the header area is cleared by
    each write, so nothing of an earlier batch can leak into a later file.
    """

    def __init__(self, layout: BatchLayout):
        self.layout = layout
        self.data = np.zeros(layout.size, dtype=np.uint8)
        self.arrays = {
            f.name: self.data[o : o + f.nbytes].view(f.dtype).reshape(f.shape)
            for f, o in zip(layout.fields, layout.offsets)
        }

    def seal(self, epoch: int, step: int, rank: int, meta: dict | None = None) -> memoryview:
        """Write the header in front of the filled arrays; the whole file's bytes."""
        header = self.layout.header_bytes(epoch, step, rank, meta)
        view = memoryview(self.data)
        view[: self.layout.data_start] = bytes(self.layout.data_start)  # no tail of a longer header
        view[: len(header)] = header
        return view


class BatchWriter:
    """Writes one batch file: the batch is filled in memory (``arrays``), then ``finish``
    writes the header and the whole file with ``pwrite``.

    The free space is checked first, so a full tmpfs fails here with ENOSPC and costs no
    decoding. The file is never mapped for writing, so a filesystem that something else
    fills meanwhile fails the write with ENOSPC, never kills the writer with SIGBUS. No
    ``posix_fallocate``: on tmpfs it zeroes every page that the write then fills again,
    2.2 of the 6.2 ms a 9.6 MB batch took to write. Pass a ``BatchBuffer`` to reuse its
    memory across batches (one writer at a time per buffer). ``spare``: a file of this
    layout's size already waits at ``path`` (open_spare), to be overwritten.
    """

    def __init__(
        self, path: str | os.PathLike, layout: BatchLayout, buffer: BatchBuffer | None = None, *, spare: bool = False
    ):
        if buffer is not None and buffer.layout != layout:
            raise ValueError("the buffer was planned for another layout")
        self.layout = layout
        self._buffer = buffer or BatchBuffer(layout)
        self._fd = _open_to_write(path, layout.size, spare)
        self.arrays = self._buffer.arrays

    def finish(
        self, epoch: int, step: int, rank: int, meta: dict | None = None, *, publish_as: str | None = None
    ) -> bool:
        """Write the header and the whole file. ``publish_as`` (a path in batches/): then give
        the file written that name too (``link_written``); False if the name was taken."""
        try:
            return _write_and_publish(self._fd, self._buffer.seal(epoch, step, rank, meta), publish_as)
        finally:
            self.close()

    def close(self) -> None:
        self.arrays = {}
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def write_batch_file(path: str | os.PathLike, data, *, spare: bool = False, publish_as: str | None = None) -> bool:
    """Write a batch made elsewhere (``data``: its whole file, as ``BatchBuffer.seal`` gives
    it) to a new file, with BatchWriter's free-space check and ``pwrite``, or over the spare
    waiting at ``path``; ``publish_as`` as in ``BatchWriter.finish``."""
    fd = _open_to_write(path, len(data), spare)
    try:
        return _write_and_publish(fd, memoryview(data).cast("B"), publish_as)
    finally:
        os.close(fd)


def link_written(fd: int, path: str) -> bool:
    """Publish the file open as ``fd`` under ``path``: a hard link, atomic like rename, but it
    fails if the name exists (False), so a batch is published once whoever made it. Linked
    through ``/proc/self/fd``, so the name goes to the file this process wrote, whatever now
    stands at its temporary name (linked by that name, a symlink a process swapped in there was
    published in its place)."""
    folder, name = os.path.split(path)
    dir_fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)  # linkat, AT_SYMLINK_FOLLOW
        return True
    except FileExistsError:
        return False
    finally:
        os.close(dir_fd)


def _open_to_write(path: str | os.PathLike, size: int, spare: bool) -> int:
    """The descriptor a batch of ``size`` bytes is written through: over the spare waiting at
    ``path``, or a new file there."""
    return open_spare(path, size) if spare else _create_with_room(path, size)


def open_spare(path: str | os.PathLike, size: int) -> int:
    """A descriptor for overwriting the spare file at ``path``: a regular file of ``size``
    bytes with no other name, whose pages the write reuses. Anything else there (gone, another
    size, a second name that could lead out of the job folder, a symlink or a FIFO: the daemon's
    folder is ours, so only a bug or a hand could put it there) is removed and a new file made
    in its place, with the free-space check; a folder fails the batch, as it fails a create."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return _create_with_room(path, size)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO):  # a symlink; a FIFO with no reader
            raise
    else:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size == size and st.st_nlink == 1:
            return fd
        os.close(fd)
    os.unlink(path)
    return _create_with_room(path, size)


def _create_with_room(path: str | os.PathLike, size: int) -> int:
    """A new file's descriptor; ENOSPC (and no file) when its filesystem lacks ``size`` bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fs = os.fstatvfs(fd)
        if fs.f_bavail * fs.f_frsize < size:
            why = f"{os.strerror(errno.ENOSPC)}: a batch needs {size} bytes"
            raise OSError(errno.ENOSPC, why, str(path))
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def _write_and_publish(fd: int, view: memoryview, publish_as: str | None) -> bool:
    """The whole file's bytes through ``fd``, then its name in batches/ where asked (False: taken)."""
    _write_all(fd, view)
    return publish_as is None or link_written(fd, publish_as)


def _write_all(fd: int, view: memoryview) -> None:
    pos = 0
    while pos < len(view):  # pwrite may write less than asked; ENOSPC raises OSError
        pos += os.pwrite(fd, view[pos:], pos)
