"""A received region's files into a directory, all or nothing.

:func:`write_files` (or :class:`ModelWriter`, which starts while the bytes land) validates every
name and target first; writes every
file under a temporary ``.tensorxfer-*.part`` name in the target directory
and fsyncs it; only then renames them into place, and if a rename fails the
ones already renamed are rolled back (files they replaced are restored).
:func:`clean_leftovers` removes the temporary files a killed writer left
behind.  GPU regions are drained through two pinned staging buffers
(:mod:`tensorxfer.staging`).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import functools
import os
import queue
import secrets
import stat
import tempfile
import threading
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

from tensorxfer.errors import ProtocolError, TensorXferError, TransferError
from tensorxfer.files.format import HEADER_LENGTH, TEMP_PREFIX, FileFormatError, OutputError, fsync_dir
from tensorxfer.files.layout import FilePlan, plan_files
from tensorxfer.files.sources import is_model_file
from tensorxfer.staging import open_stager, read_pieces

STAGE_BYTES = 32 << 20              # each of the two pinned buffers for GPU regions
COPY_STEP = 64 << 20                # copy_files: bytes per copy_file_range call (progress, writeback start)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)      # no /proc: read it by setting it (briefly process-wide)
    os.umask(mask)
    return mask


def clean_leftovers(out_dir: str | os.PathLike[str],
                    keep: frozenset[str] = frozenset()) -> tuple[list[Path], list[Path]]:
    """Remove the ``.tensorxfer-*.part`` files a killed writer left in ``out_dir``.

    Only regular files with that name are removed (never symlinks or
    directories).  ``.tensorxfer-*.bak`` files — what a file being replaced
    held, left only if a writer died in the middle of its renames or a
    rollback failed — are kept: they may be the only copy; so are the ``keep``
    names (the temporary files a resume journal names).  Returns
    ``(removed, kept backups)``; a missing directory has nothing to clean.
    """
    removed: list[Path] = []
    backups: list[Path] = []
    try:
        names = sorted(os.listdir(out_dir))
    except FileNotFoundError:
        return removed, backups
    for n in names:
        if not n.startswith(TEMP_PREFIX) or n in keep:
            continue
        p = Path(out_dir) / n
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            if n.endswith(".part"):
                os.unlink(p)
                removed.append(p)
            elif n.endswith(".bak"):
                backups.append(p)
    return removed, backups


def check_output_dir(out_dir: str | os.PathLike[str]) -> Path:
    """Create ``out_dir`` if needed and return it resolved.

    Raises
    ------
    OutputError
        It exists and is not a directory, or it cannot be created.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output directory {out} exists and is not a directory; pick another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create output directory {out}: {e.strerror or e}") from None
    return out.resolve()


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes this process may still write on the file system holding ``path`` (root may use the blocks
    reserved for it; others may not)."""
    st = os.statvfs(path)
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def check_free_space(plans: Sequence[FilePlan], out_dir: str | os.PathLike[str]) -> int:
    """Refuse, before any data moves, files that cannot fit in ``out_dir``; return the bytes they need there.

    The need is every file rounded up to whole blocks; files being replaced count in full, since the old
    ones stay until the new ones are in place (all or nothing).

    Raises
    ------
    OutputError
        (errno ENOSPC) Fewer bytes are free than the files need; the message has both numbers and the path.
    """
    st = os.statvfs(out_dir)
    block = st.f_frsize or 4096
    total = sum(fp.size for fp in plans)
    need = sum(-(-fp.size // block) * block for fp in plans)
    free = free_bytes(out_dir)
    if need > free:
        raise OutputError(errno.ENOSPC, f"not enough free space in {out_dir}: the {_files(len(plans))} hold "
                                        f"{total:,} bytes ({_gb(total)}), {need:,} bytes on disk, and "
                                        f"{free:,} bytes ({_gb(free)}) are free there; free {need - free:,} "
                                        f"bytes or pick another --out; nothing was written")
    return need


def _files(n: int) -> str:
    return "1 file" if n == 1 else f"{n} files"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def other_model_files(plans: Sequence[FilePlan], out_dir: str | os.PathLike[str]) -> list[Path]:
    """The files of a model already in ``out_dir`` that these files do not replace (weights, indexes,
    configs, tokenizer files: :func:`~tensorxfer.files.sources.is_model_file`; hidden files, directories
    and the user's other files are never counted)."""
    names = {fp.name for fp in plans}
    try:
        present = sorted(os.listdir(out_dir))
    except FileNotFoundError:
        return []
    found = []
    for n in present:
        if n in names or n.startswith(".") or not is_model_file(n):
            continue
        p = Path(out_dir) / n
        with contextlib.suppress(FileNotFoundError):
            mode = os.lstat(p).st_mode
            if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
                found.append(p)
    return found


def check_other_model(plans: Sequence[FilePlan], out_dir: str | os.PathLike[str],
                      overwrite: bool = False) -> list[Path]:
    """Refuse to mix these files with another model's in ``out_dir``, unless ``overwrite``; return the other
    model's files (which ``overwrite`` removes once the new files are in place).

    Raises
    ------
    OutputError
        (errno EEXIST) ``out_dir`` holds model files these do not replace, and ``overwrite`` is false.
    """
    others = other_model_files(plans, out_dir)
    if others and not overwrite:
        shown = ", ".join(p.name for p in others[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        raise OutputError(errno.EEXIST, f"{out_dir} holds another model's files that this transfer does not "
                                        f"replace ({shown}); the two models would be mixed. Pick an empty "
                                        f"output folder, remove them, or let the transfer replace them "
                                        f"(tensorxfer-recv --overwrite; in Python, overwrite=True), which "
                                        f"removes them once the new files are in place; nothing was written")
    return others


def _check_target(path: Path) -> bool:
    """Whether a file already exists at ``path`` (to be replaced); raise if nothing may be put there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path} is a directory; nothing was written (move it away and send again)")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise OutputError(f"{path} exists and is not a regular file; nothing was written")
    return True


def write_files(region: Any, out_dir: str | os.PathLike[str], overwrite: bool = False,
                progress: Callable[[int], None] | None = None) -> list[Path]:
    """Write the files a region carries into ``out_dir``, all or nothing; return their paths.

    ``progress(n)`` is called after each ``n`` bytes written (the files' sizes add up to
    ``sum(plan.size for plan in plan_files(region.manifest))``).  :class:`ModelWriter` does it, and can
    start while the region is still landing.

    Every name and target is validated first (a directory or a special file
    at a target name refuses the whole set), and ``out_dir`` must not hold
    another model's files that these do not replace (:func:`check_other_model`)
    unless ``overwrite``, which removes them after the new files are in place
    (restored, like every replaced file, if anything fails).  Every file is then written
    under a temporary name in ``out_dir``, given the sender's permission
    bits (masked by this process's umask; never setuid/setgid/sticky), and
    fsynced.  Only then are they renamed into place (a rename replaces a
    symlink at the target name, it never follows it); if a rename fails,
    the files already renamed are rolled back — a file they replaced is
    restored.  On any error nothing new is left in ``out_dir``.

    Raises
    ------
    FileFormatError
        The layout is malformed or names a file outside ``out_dir``.
    OutputError
        A target cannot be written (a directory is in the way, ``out_dir``
        is not a directory, another model's files are there and not
        ``overwrite``), or writing a file failed (its ``errno`` kept,
        e.g. ENOSPC; the message names the file).  Callers that can refuse
        early check the space first (:func:`check_free_space`).
    OSError
        Renaming into place failed (the renames already done are rolled back).
    """
    writer = ModelWriter(region.manifest, out_dir, overwrite, progress)
    return writer.finish(region)


class ModelWriter:
    """A received model's files, written under temporary names while the region lands, then committed.

    Made at offer time (every check of :func:`write_files` runs then: names, targets, another model's
    files, and with ``check_space`` the free space); the temporary files are created and their headers
    and side files written at once.
    :meth:`land` takes ranges of a host region as they land (a transport's ``on_piece``: it only queues
    them) and a writer thread copies their tensor bytes to their places in the files -- the disk works
    while the network does.  :meth:`finish` writes whatever was not written yet (everything, for a GPU
    region or a transport that reports no pieces), fsyncs, and renames all into place, all or nothing;
    :meth:`abort` removes the temporary files (or, ``keep``, leaves them for a resumed run).  One owner;
    after either, the writer is spent.

    ``reuse`` (file index -> path): temporary files an interrupted run left (:mod:`tensorxfer.files.resume`
    checked them), reopened instead of made, cut to the file's size, their bytes kept; ``on_written(view,
    file index, file position, n)`` is told, in the writer thread, of tensor bytes written while landing
    (``view``: the region's memory).
    """

    def __init__(self, manifest: Any, out_dir: str | os.PathLike[str], overwrite: bool = False,
                 progress: Callable[[int], None] | None = None, check_space: bool = False,
                 reuse: dict[int, str] | None = None,
                 on_written: Callable[[memoryview, int, int, int], None] | None = None) -> None:
        self._plans = plan_files(manifest)
        self._real = real = check_output_dir(out_dir)
        self.targets = [real / fp.name for fp in self._plans]
        for t in self.targets:
            if t.parent != real:
                raise FileFormatError(f"{t}: would land outside {real}")
            _check_target(t)
        self.others = check_other_model(self._plans, real, overwrite)    # removed at commit (overwrite)
        if check_space:
            check_free_space(self._plans, real)
        self._progress = progress or _no_progress
        self._on_written = on_written
        self._temps: list[tuple[str, int]] = []     # (name, fd) per file
        # every tensor's bytes: (region offset, n, file index, position in the file), by region offset
        spans: list[tuple[int, int, int, int]] = []
        self._queue: queue.SimpleQueue[tuple[Any, int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._done = False
        self._meta_bytes = 0                    # headers and side files, written at once
        umask = _umask()
        try:
            for i, fp in enumerate(self._plans):
                if reuse and i in reuse:
                    tmp = reuse[i]
                    fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                    self._temps.append((tmp, fd))
                    if not stat.S_ISREG(os.fstat(fd).st_mode) or Path(tmp).parent != real:
                        raise OutputError(f"{tmp}: not a temporary file of this receiver; nothing was written")
                    self._guarded(i, os.ftruncate, fd, fp.size)    # what lies beyond the file never stays
                else:
                    fd, tmp = tempfile.mkstemp(dir=real, prefix=TEMP_PREFIX, suffix=".part")
                    self._temps.append((tmp, fd))
                self._guarded(i, os.fchmod, fd, fp.mode & ~umask)
                if fp.header is None:
                    assert fp.data is not None
                    self._guarded(i, _pwrite_all, fd, fp.data, 0)
                    self._meta_bytes += len(fp.data)
                    continue
                head = fp.text.encode("utf-8")
                self._guarded(i, _pwrite_all, fd, HEADER_LENGTH.pack(len(head)) + head, 0)
                self._meta_bytes += HEADER_LENGTH.size + len(head)
                pos = HEADER_LENGTH.size + len(head)
                for spec in manifest.tensors[fp.first_tensor:fp.first_tensor + len(fp.header.entries)]:
                    spans.append((spec.offset, spec.nbytes, i, pos))
                    pos += spec.nbytes
        except BaseException:
            self.abort()
            raise
        spans.sort()
        self._spans = spans
        self._starts = [s[0] for s in spans]
        self._written = [0] * len(spans)        # bytes of each span written while landing

    # ---------------------------------------------------------------- while landing
    def land(self, region: Any, offset: int, length: int) -> None:
        """``[offset, offset+length)`` of the host ``region`` landed: queue its bytes for the files (from
        transport threads; never raises, never blocks)."""
        with self._lock:
            if self._thread is None and not self._done:
                self._thread = threading.Thread(target=self._drain_queue, name="tensorxfer-write-landed",
                                                daemon=True)
                self._thread.start()
        self._queue.put((region, offset, length))

    def _drain_queue(self) -> None:
        view = None
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                region, offset, length = item
                if self._error is not None:
                    continue
                if view is None:
                    view = memoryview(region.region)
                self._write_range(view, offset, offset + length)
        except BaseException as e:
            self._error = e
        finally:
            if view is not None:
                view.release()

    def _write_range(self, view: memoryview, a: int, b: int) -> None:
        k = max(0, bisect.bisect_right(self._starts, a) - 1)
        while k < len(self._spans) and self._spans[k][0] < b:
            off, n, i, pos = self._spans[k]
            lo, hi = max(a, off), min(b, off + n)
            if lo < hi:
                self._guarded(i, _pwrite_all, self._temps[i][1], view[lo:hi], pos + lo - off)
                _start_writeback(self._temps[i][1], pos + lo - off, hi - lo)
                self._written[k] += hi - lo     # reported by finish(): the caller's bar is on the data meanwhile
                if self._on_written is not None:
                    self._on_written(view, i, pos + lo - off, hi - lo)
            k += 1

    def mark_written(self, offset: int, length: int) -> None:
        """``[offset, offset+length)`` of the region is in the temporary files already (kept from an
        interrupted run, before any byte lands): :meth:`finish` does not write it again."""
        k = max(0, bisect.bisect_right(self._starts, offset) - 1)
        end = offset + length
        while k < len(self._spans) and self._spans[k][0] < end:
            off, n, _, _ = self._spans[k]
            lo, hi = max(offset, off), min(end, off + n)
            if lo < hi:
                self._written[k] += hi - lo
            k += 1

    def temp_path(self, i: int) -> str:
        """File ``i``'s temporary file."""
        return self._temps[i][0]

    def sync(self, i: int) -> None:
        """fdatasync file ``i``'s temporary file (before a journal names its bytes)."""
        self._guarded(i, os.fdatasync, self._temps[i][1])

    def _guarded(self, i: int, write: Callable[..., object], *args: Any) -> None:
        """``write(*args)`` on file ``i``; an OSError becomes an OutputError naming the file and the space left."""
        try:
            write(*args)
        except OSError as e:
            if isinstance(e, TensorXferError) or e.errno is None:
                raise
            fp = self._plans[i]
            free = ""
            with contextlib.suppress(OSError):
                free = f" ({free_bytes(self._real):,} bytes free there now)"
            raise OutputError(e.errno, f"writing {fp.name} ({fp.size:,} bytes) into {self._real} failed: "
                                       f"{e.strerror}{free}; nothing was written") from e

    def copy_files(self, files: Sequence[tuple[int, int, int]], report: Callable[[int], None]) -> None:
        """Copy every tensor's bytes straight from the sender's files into the temporary files: ``files``
        is ``(region offset, length, fd)`` of each (a same-host sender whose region is its files mapped; the
        transport's ``on_files`` hook), ``report(n)`` is called as bytes are copied.  One copy in the kernel
        (``copy_file_range``, as ``cp`` does; ``pread``/``pwrite`` where the two files' file systems do not
        allow it): no page of the model passes through this process, and the fds are never mapped, so a
        file cut short meanwhile fails the copy instead of raising SIGBUS.  :meth:`finish` then only fsyncs
        and renames.

        Raises
        ------
        ProtocolError
            A tensor lies outside every file (the sender's placements do not hold its manifest).
        TransferError
            A file ended before a tensor's bytes did (it shrank while being sent).
        OutputError
            Writing a temporary file failed (e.g. ENOSPC), naming it.
        """
        starts = [f[0] for f in files]
        for k, (off, n, i, pos) in enumerate(self._spans):
            if n == 0:
                continue        # an empty tensor has no bytes to find in any file
            j = bisect.bisect_right(starts, off) - 1
            if j < 0 or off + n > files[j][0] + files[j][1]:
                raise ProtocolError(f"ipc: the sender's files do not hold the bytes of {self._plans[i].name} "
                                    f"at region offset {off} ({n} bytes): its placements do not match its "
                                    f"manifest")
            base, _, src = files[j]
            done = self._written[k]
            while done < n:
                step = min(n - done, COPY_STEP)
                self._guarded(i, _copy_range, src, off - base + done, self._temps[i][1], pos + done, step,
                              self._plans[i].name)
                _start_writeback(self._temps[i][1], pos + done, step)
                done += step
                self._written[k] = done
                report(step)

    @property
    def written_while_landing(self) -> int:
        """Tensor bytes already in the files before :meth:`finish` (read it after finish: the writer thread
        has then stopped)."""
        return sum(self._written)

    # ---------------------------------------------------------------- the end
    def finish(self, region: Any) -> list[Path]:
        """Every byte of ``region`` landed: write what is missing, fsync, rename into place (see
        :func:`write_files`); return the paths.  On any error nothing new is left in the directory."""
        try:
            self._stop_thread()
            if self._error is not None:
                raise self._error
            # what was written already, then spans not (wholly) written while landing, written whole
            self._progress(self._meta_bytes + sum(self._written))
            missing = [k for k, (_, n, _, _) in enumerate(self._spans) if self._written[k] != n]
            with _Drain(region) as drain:
                for k in missing:
                    off, n, i, pos = self._spans[k]
                    left = n - self._written[k]
                    pieces = drain.pieces([(off, n)])
                    with contextlib.closing(pieces):     # a failed write releases the view at once
                        for piece in pieces:
                            self._guarded(i, _pwrite_all, self._temps[i][1], piece, pos)
                            pos += len(piece)
                    self._progress(left)
            for i, (_, fd) in enumerate(self._temps):
                self._guarded(i, os.fsync, fd)
        except BaseException:
            self.abort()
            raise
        self._close_fds()
        return self._commit()

    def abort(self, keep: bool = False) -> None:
        """Remove the temporary files (an update that failed), or with ``keep`` leave them for a resumed
        run (every landed byte queued is written first); idempotent."""
        self._stop_thread()
        self._close_fds()
        temps, self._temps = self._temps, []
        if keep:
            return
        for tmp, _ in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def drain(self) -> None:
        """Stop the writer thread once every range queued so far is in the files (before a resumable abort
        journals them)."""
        self._stop_thread()

    def _stop_thread(self) -> None:
        with self._lock:
            self._done = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _close_fds(self) -> None:
        for i, (tmp, fd) in enumerate(self._temps):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                self._temps[i] = (tmp, -1)

    def _commit(self) -> list[Path]:
        real = self._real
        temps = [tmp for tmp, _ in self._temps]
        # per target being committed: (target, backup of what it replaces, whether undoing must restore the
        # backup -- i.e. the target no longer holds the old file -- or just drop the backup)
        undo: list[tuple[Path, str | None, bool]] = []
        try:
            for tmp, target in zip(temps, self.targets):
                backup = None
                if _check_target(target):
                    backup = str(real / f"{TEMP_PREFIX}{secrets.token_hex(8)}.bak")
                    try:
                        os.link(target, backup, follow_symlinks=False)   # the old file stays in place meanwhile
                        undo.append((target, backup, False))
                    except OSError:
                        os.rename(target, backup)                       # no hard links here: move it aside
                        undo.append((target, backup, True))
                if backup is None:
                    undo.append((target, None, False))
                os.replace(tmp, target)
                undo[-1] = (target, backup, True)                       # renamed: undoing restores the backup
            for other in self.others:                                  # overwrite: the old model's other files go
                backup = str(real / f"{TEMP_PREFIX}{secrets.token_hex(8)}.bak")
                os.rename(other, backup)
                undo.append((other, backup, True))
            for _, backup, _ in undo:
                if backup is not None:
                    os.unlink(backup)
            fsync_dir(real)
        except BaseException as e:
            lost = _roll_back(undo)
            for tmp in temps:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            self._temps = []
            with contextlib.suppress(OSError):
                fsync_dir(real)
            if lost:
                raise OutputError(f"writing the files failed ({type(e).__name__}: {e}) and rolling back failed "
                                  f"too: the previous contents are kept in {'; '.join(lost)}") from e
            raise
        self._temps = []
        return self.targets


def _no_progress(n: int) -> None:
    pass


@functools.cache
def _sync_file_range() -> Any:
    """libc's sync_file_range (Linux), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _start_writeback(fd: int, pos: int, n: int) -> None:
    """Start writing ``[pos, pos+n)`` of the file to disk now, without waiting (SYNC_FILE_RANGE_WRITE): the
    disk writes while the rest lands, and the final fsync waits only for the tail.  Advisory: a failure
    here shows again, and is reported, at that fsync."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, pos, n, 2)


def _copy_range(src: int, src_pos: int, dst: int, dst_pos: int, n: int, name: str) -> None:
    """Copy ``n`` bytes of file ``src`` at ``src_pos`` into file ``dst`` at ``dst_pos`` in the kernel.

    Raises TransferError when ``src`` ends first (named ``name``: the file these bytes are for), OSError
    when writing fails."""
    in_kernel = hasattr(os, "copy_file_range")
    while n > 0:
        if in_kernel:
            try:
                got = os.copy_file_range(src, dst, n, src_pos, dst_pos)
            except OSError as e:
                # another file system, an old kernel, a file system without it: the same bytes by pread/pwrite
                if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
                    raise
                in_kernel = False
                continue
        else:
            data = os.pread(src, min(n, 8 << 20), src_pos)
            got = len(data)
            if got:
                _pwrite_all(dst, data, dst_pos)
        if got <= 0:
            raise TransferError(f"the sender's file for {name} ended {n:,} bytes short of its tensors: it shrank "
                                f"while being sent; send it again once it is written")
        src_pos, dst_pos, n = src_pos + got, dst_pos + got, n - got


def _pwrite_all(fd: int, data: Any, pos: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def _roll_back(undo: list[tuple[Path, str | None, bool]]) -> list[str]:
    """Undo a partial commit, newest first; returns "target <- backup" for backups that could not be restored
    (they are kept, never deleted)."""
    lost = []
    for target, backup, restore in reversed(undo):
        try:
            if backup is None:
                if restore:
                    os.unlink(target)        # a new file where there was none
            elif restore:
                os.replace(backup, target)
            else:
                os.unlink(backup)            # the target still holds the old file
        except FileNotFoundError:
            pass
        except OSError:
            if backup is not None and restore:
                lost.append(f"{target} <- {backup}")
    return lost


class _Drain:
    """Reads region bytes in order, for writing files: zero-copy slices of a host region, pinned
    staging buffers (double-buffered device-to-host copies) for a GPU region — one
    :func:`tensorxfer.staging.read_pieces` loop either way, one stager for all the files."""

    def __init__(self, region: Any) -> None:
        self.region = region
        self._stager: Any = None

    def __enter__(self) -> _Drain:
        self._stager = open_stager(self.region, STAGE_BYTES)
        return self

    def __exit__(self, *exc: object) -> None:
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()

    def pieces(self, spans: list[tuple[int, int]]) -> Generator[memoryview, None, None]:
        """Memoryviews of the bytes of ``(offset, n)`` spans, in order; each valid until the next."""
        for off, n in spans:
            with read_pieces(self.region, off, n, STAGE_BYTES, stager=self._stager) as pieces:
                for _, view in pieces:
                    yield view
