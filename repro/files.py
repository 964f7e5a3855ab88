"""A file written whole or not at all, the one way every layer writes one (report files, redacted records, the gate's
cache and model configs): a temporary file beside it, flushed to disk, given the mode of the file it replaces (a new
file: the umask's default, as open() gives it), then renamed into place in one step; on any exception, Ctrl-C
included, the temporary is removed and the file is as it was. Only a regular file (or a new one) is ever replaced:
a device node (`/dev/null`), a fifo, a socket, a folder or a symbolic link at the path is refused (ConfigError) and
kept.

And a file read whole, the one way a command reads a file the user gave (a results.json, an index, a JUnit XML): a
regular file only (a device such as `/dev/zero` or a fifo never is read), at most a size bound, and JSON at most a
nesting depth deep: anything else is ConfigError, one line, never a MemoryError or RecursionError."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from repro.errors import ConfigError

READ_LIMIT = 256 << 20  # bytes: the largest recorded results.json is a few MiB
JSON_DEPTH = 64  # nesting levels: a recorded document is under 10 deep


@contextlib.contextmanager
def replacing(path: str | Path, durable: bool = True) -> Iterator[Path]:
    """The whole file or none of it: the caller writes the temporary file this yields (beside `path`), which is
    flushed (fsync, unless not `durable`: a file that must outlive its writer's kill, which the page cache keeps, not
    the machine's loss), given the mode of the regular file at `path` (a new file's: 0666 less the umask) and renamed
    into place when the block ends. A path that is not a regular file (a link, a device, a fifo, a folder) is refused
    and kept (check_target)."""
    target = Path(path).absolute()
    check_target(target, str(path))
    tmp = None
    try:
        tmp = _new_beside(target)
        yield tmp
        _keep_mode(target, tmp)
        if durable:
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


def write_whole(path: str | Path, data: bytes | str, durable: bool = True) -> None:
    """`data` (bytes, or text in the locale's encoding as write_text writes it) into `path` (replacing)."""
    with replacing(path, durable) as tmp:
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


def check_target(path: str | Path, shown: str | None = None, flag: str = "") -> None:
    """ConfigError when `path` exists and is not a regular file (a link, a device node, a fifo, a socket, a folder):
    none of those is ever replaced. `shown`: the path as the user gave it; `flag`: the option that named it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"{flag + ' ' if flag else ''}{shown or path}: cannot see it ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"{flag + ' ' if flag else ''}{shown or path}: is {_kind(st.st_mode)}, not a regular file: give a file "
            "name (it is kept)"
        )


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a device (character)"),
        (stat.S_ISBLK, "a device (block)"),
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def read_bounded(path: str | Path, limit: int = READ_LIMIT, flag: str = "") -> bytes:
    """The bytes of the regular file at `path` (a link to one is read), at most `limit`; ConfigError, one line, for
    anything else: a device (`/dev/zero`, `/dev/full`), a fifo (opened without waiting for a writer), a folder, a
    larger file, one that cannot be read."""
    who = f"{flag + ' ' if flag else ''}{path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"{who}: cannot read it ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{who}: is {_kind(st.st_mode)}, not a regular file: nothing read")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise ConfigError(f"{who}: {st.st_size} bytes, over the {limit >> 20} MiB this command reads")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ConfigError(f"{who}: cannot read it ({e.strerror or e})") from None
    if len(data) > limit:  # it grew while read
        raise ConfigError(f"{who}: over the {limit >> 20} MiB this command reads")
    return data


def load_json(path: str | Path, limit: int = READ_LIMIT, depth: int = JSON_DEPTH, flag: str = "") -> object:
    """The JSON document in the regular file at `path` (read_bounded), at most `depth` levels deep; ConfigError, one
    line, when it is not one (not UTF-8, not JSON, too deep)."""
    data = read_bounded(path, limit, flag)
    return loads(data, depth, f"{flag + ' ' if flag else ''}{path}")


def loads(data: bytes | str, depth: int = JSON_DEPTH, who: str = "the document") -> object:
    """json.loads with a depth bound (see load_json)."""
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ConfigError(f"{who}: JSON nested deeper than {depth} levels: not a document this command reads") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{who}: not JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if _depth_over(doc, depth):
        raise ConfigError(f"{who}: JSON nested deeper than {depth} levels: not a document this command reads")
    return doc


def _depth_over(doc: object, depth: int) -> bool:
    """Whether `doc` nests deeper than `depth` (walked without recursion)."""
    todo = [(doc, 1)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, (dict, list)):
            if level > depth:
                return True
            todo.extend((v, level + 1) for v in (node.values() if isinstance(node, dict) else node))
    return False
