"""A file written whole or not at all, the one way every layer writes one (report files, redacted records, the gate's
cache and model configs): a temporary file beside it, flushed to disk, given the mode of the file it replaces (a new
file: the umask's default, as open() gives it), then renamed into place in one step; on any exception, Ctrl-C
included, the temporary is removed and the file is as it was."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | Path, *, through_link: bool = False) -> Iterator[Path]:
    """The whole file or none of it: the caller writes the temporary file this yields (beside `path`), which is
    flushed, given the mode of the regular file at `path` (a new file's: 0666 less the umask) and renamed into place
    when the block ends. A link at `path` is replaced (a new file's mode), never written through, unless
    `through_link`: then the file it leads to is replaced, its mode kept."""
    target = Path(os.path.realpath(path)) if through_link else Path(path).absolute()
    tmp = None
    try:
        tmp = _new_beside(target)
        yield tmp
        _keep_mode(target, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def write_whole(path: str | Path, data: bytes | str, *, through_link: bool = False) -> None:
    """`data` (bytes, or text in the locale's encoding as write_text writes it) into `path` (replacing)."""
    with replacing(path, through_link=through_link) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)


def _new_beside(target: Path) -> Path:
    """A new, empty, hidden file in `target`'s folder, made as open() makes one (0666 less the umask: the kernel
    applies it, so no thread ever sees the umask changed)."""
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp


def _keep_mode(target: Path, tmp: Path) -> None:
    """The mode of the regular file at `target` (a link there is not one), if any, given to `tmp`."""
    try:
        st = os.stat(target, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode):
        os.chmod(tmp, stat.S_IMODE(st.st_mode))
