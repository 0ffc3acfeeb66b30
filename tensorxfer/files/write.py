"""A received region's files into a directory, all or nothing.

:func:`write_files` validates every name and target first; writes every
file under a temporary ``.tensorxfer-*.part`` name in the target directory
and fsyncs it; only then renames them into place, and if a rename fails the
ones already renamed are rolled back (files they replaced are restored).
:func:`clean_leftovers` removes the temporary files a killed writer left
behind.  GPU regions are drained through two pinned staging buffers
(:mod:`tensorxfer.staging`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import tempfile
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

from tensorxfer.errors import TensorXferError
from tensorxfer.files.format import HEADER_LENGTH, TEMP_PREFIX, FileFormatError, OutputError
from tensorxfer.files.layout import FilePlan, plan_files
from tensorxfer.files.sources import is_model_file
from tensorxfer.staging import open_stager, read_pieces

STAGE_BYTES = 32 << 20              # each of the two pinned buffers for GPU regions


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


def clean_leftovers(out_dir: str | os.PathLike[str]) -> tuple[list[Path], list[Path]]:
    """Remove the ``.tensorxfer-*.part`` files a killed writer left in ``out_dir``.

    Only regular files with that name are removed (never symlinks or
    directories).  ``.tensorxfer-*.bak`` files — what a file being replaced
    held, left only if a writer died in the middle of its renames or a
    rollback failed — are kept: they may be the only copy.  Returns
    ``(removed, kept backups)``; a missing directory has nothing to clean.
    """
    removed: list[Path] = []
    backups: list[Path] = []
    try:
        names = sorted(os.listdir(out_dir))
    except FileNotFoundError:
        return removed, backups
    for n in names:
        if not n.startswith(TEMP_PREFIX):
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
                                        f"--out, remove them, or receive with --overwrite (overwrite=True), "
                                        f"which removes them once the new files are in place; nothing was "
                                        f"written")
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


def _fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_files(region: Any, out_dir: str | os.PathLike[str], overwrite: bool = False,
                progress: Callable[[int], None] | None = None) -> list[Path]:
    """Write the files a region carries into ``out_dir``, all or nothing; return their paths.

    ``progress(n)`` is called after each ``n`` bytes written (the files' sizes add up to
    ``sum(plan.size for plan in plan_files(region.manifest))``).

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
    plans = plan_files(region.manifest)
    real = check_output_dir(out_dir)
    targets = [real / fp.name for fp in plans]
    for t in targets:
        if t.parent != real:
            raise FileFormatError(f"{t}: would land outside {real}")
        _check_target(t)
    others = check_other_model(plans, real, overwrite)
    umask = _umask()
    temps: list[str] = []
    # per target being committed: (target, backup of what it replaces, whether undoing must restore the backup
    # — i.e. the target no longer holds the old file — or just drop the backup)
    undo: list[tuple[Path, str | None, bool]] = []
    try:
        with _Drain(region) as drain:
            for fp in plans:
                try:
                    temps.append(_write_temp(region, drain, fp, real, umask, progress or _no_progress))
                except OSError as e:
                    if isinstance(e, TensorXferError) or e.errno is None:
                        raise
                    # name the file (a bare "[Errno 28] No space left on device" names none) and the space
                    free = ""
                    with contextlib.suppress(OSError):
                        free = f" ({free_bytes(real):,} bytes free there now)"
                    raise OutputError(e.errno, f"writing {fp.name} ({fp.size:,} bytes) into {real} failed: "
                                               f"{e.strerror}{free}; nothing was written") from e
        for tmp, target in zip(temps, targets):
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
        for other in others:                                        # overwrite: the old model's other files go
            backup = str(real / f"{TEMP_PREFIX}{secrets.token_hex(8)}.bak")
            os.rename(other, backup)
            undo.append((other, backup, True))
        for _, backup, _ in undo:
            if backup is not None:
                os.unlink(backup)
        _fsync_dir(real)
    except BaseException as e:
        lost = _roll_back(undo)
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        with contextlib.suppress(OSError):
            _fsync_dir(real)
        if lost:
            raise OutputError(f"writing the files failed ({type(e).__name__}: {e}) and rolling back failed too: "
                              f"the previous contents are kept in {'; '.join(lost)}") from e
        raise
    return targets


def _no_progress(n: int) -> None:
    pass


def _write_temp(region: Any, drain: _Drain, fp: FilePlan, real: Path, umask: int,
                progress: Callable[[int], None]) -> str:
    """Write one file under a temporary name in ``real``, fsynced; return that name (removed on failure)."""
    fd, tmp = tempfile.mkstemp(dir=real, prefix=TEMP_PREFIX, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), fp.mode & ~umask)
            if fp.header is None:
                assert fp.data is not None
                f.write(fp.data)
                progress(len(fp.data))
            else:
                head = fp.text.encode("utf-8")
                f.write(HEADER_LENGTH.pack(len(head)))
                f.write(head)
                progress(HEADER_LENGTH.size + len(head))
                specs = region.manifest.tensors[fp.first_tensor:fp.first_tensor + len(fp.header.entries)]
                pieces = drain.pieces([(s.offset, s.nbytes) for s in specs])
                with contextlib.closing(pieces):     # a failed write releases the view at once
                    for piece in pieces:
                        f.write(piece)
                        progress(len(piece))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


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
