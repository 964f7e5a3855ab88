"""What the subcommands share: defaults (their one-line-error parser is repro.exit_codes.Parser), list and path parsing,
output folders and files that fail before any work, the attention-shape flags."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import time
import zipfile
from pathlib import Path

from repro.backends import BACKENDS
from repro.case.descriptors import AttnConfig
from repro.case.poison import DEFAULT_POISON, parse_poison
from repro.cli.outputs import OVERWRITE_HELP, check_writable
from repro.errors import ConfigError, Unavailable
from repro.run.process import MAX_WAIT_S
from repro.run.smcontrol import device_sm_count

DEFAULT_MODES = "eager,graph"
MAX_REPEAT = 1000  # --repeat: every repetition is a case of its own, planned (and listed) before any runs


def seconds(text: str) -> float:
    """argparse type of a duration: a positive, finite number of seconds (nan and inf are no duration), at most
    MAX_WAIT_S (a week: the longest wait Python's waits take whole)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    if value > MAX_WAIT_S:
        raise argparse.ArgumentTypeError(f"at most {MAX_WAIT_S} seconds (a week), got {text!r}")
    return value


def positive(text: str) -> float:
    """argparse type of a positive, finite number (nan and inf are none)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number, got {text!r}")
    return value


MAX_SPLITS = 256  # FA3 refuses more splits than this


def splits(values: tuple[int, ...], flag: str) -> tuple[int, ...]:
    """FA3 num_splits values: 0 (its heuristic) to MAX_SPLITS."""
    for n in values:
        if not 0 <= n <= MAX_SPLITS:
            raise ConfigError(f"{flag} {n}: FA3 takes 0 (its heuristic) to {MAX_SPLITS} splits")
    return values


def repeats(text: str) -> int:
    """argparse type of --repeat: 1 to MAX_REPEAT runs of every case (each one a case of its own, listed up front)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_REPEAT:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_REPEAT}, got {text!r}")
    return value


class Given(argparse.Action):
    """An option stored as argparse stores it, its dest added to the namespace's `given`: a value given is told apart
    from its default, so an option another makes moot is refused only when it was given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


class GivenFlag(Given):
    """A flag (store_true) told apart from its default as Given tells an option."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=False, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, True, option_string)


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from None


def parse_items(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def parse_backends(text: str) -> tuple[str, ...]:

    names = parse_items(text)
    for b in names:
        if b not in BACKENDS:
            raise ConfigError(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    return names


def add_shape_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("attention shape")
    d = AttnConfig()
    g.add_argument("--q-heads", type=int, default=d.num_heads_q, help="query heads (default %(default)s)")
    g.add_argument("--kv-heads", type=int, default=d.num_heads_kv, help="key/value heads (default %(default)s)")
    g.add_argument("--head-dim", type=int, default=d.head_dim, help="head dimension (default %(default)s)")
    g.add_argument("--page-size", type=int, default=d.page_size, help="KV cache page size (default %(default)s)")
    g.add_argument(
        "--max-model-len", type=int, default=d.max_model_len, help="longest sequence, in tokens (default %(default)s)"
    )
    g.add_argument(
        "--spec-tokens",
        type=int,
        default=d.num_speculative_tokens,
        help="speculative tokens per request: each decode step has 1 + this many query tokens (default %(default)s)",
    )
    g.add_argument(
        "--capture-sizes",
        default=",".join(map(str, d.capture_sizes)),
        help="CUDA-graph capture sizes (default %(default)s)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests in a batch (default %(default)s)"
    )
    g.add_argument("--window", type=int, default=-1, help="sliding window (left); -1 = none (default)")
    g.add_argument("--non-causal", action="store_true", help="non-causal attention (default: causal)")
    p.add_argument("--timeout", type=seconds, default=120.0, help="seconds per case process (default %(default)s)")
    p.add_argument(
        "--poison",
        default=DEFAULT_POISON,
        help="fill of the entries FA3 never writes: none, zero, minus-one, int-max, int-min, splits-33 or an int32 "
        "(default %(default)s: the fill that made stale faults repeatable on the H200)",
    )
    p.add_argument("--sanitizer", action="store_true", help="run under compute-sanitizer memcheck (default off)")
    p.add_argument(
        "--out", help="a new or empty folder for logs and reports (default: a new folder under the system temp folder)"
    )
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def shape_config(a: argparse.Namespace, splits: int) -> AttnConfig:
    for flag, value in (
        ("--q-heads", a.q_heads),
        ("--kv-heads", a.kv_heads),
        ("--head-dim", a.head_dim),
        ("--page-size", a.page_size),
        ("--max-model-len", a.max_model_len),
        ("--max-num-seqs", a.max_num_seqs),
    ):
        if value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
    if a.spec_tokens < 0:
        raise ConfigError(f"--spec-tokens must be >= 0, got {a.spec_tokens}")
    if a.window < -1:  # FA3 reads any negative left window as none: the case id would name a window it never had
        raise ConfigError(f"--window must be -1 (no window) or >= 0, got {a.window}")
    cfg = AttnConfig(
        num_heads_q=a.q_heads,
        num_heads_kv=a.kv_heads,
        head_dim=a.head_dim,
        page_size=a.page_size,
        max_model_len=a.max_model_len,
        causal=not a.non_causal,
        window_left=a.window,
        num_splits=splits,
        num_speculative_tokens=a.spec_tokens,
        capture_sizes=parse_ints(a.capture_sizes),
        max_num_seqs=a.max_num_seqs,
    )
    if twice := sorted({n for n in cfg.capture_sizes if cfg.capture_sizes.count(n) > 1}):  # one capture per size
        raise ConfigError(f"--capture-sizes: {twice[0]} given twice (vLLM captures each size once)")
    q, biggest = cfg.decode_query_len, max(cfg.capture_sizes)
    if -(-biggest // q) > cfg.max_num_seqs:  # vLLM captures no uniform decode batch of more requests than it schedules
        raise ConfigError(
            f"--capture-sizes {biggest} is {-(-biggest // q)} requests of {q} tokens, more than --max-num-seqs "
            f"{cfg.max_num_seqs}: lower --capture-sizes or raise --max-num-seqs"
        )
    return cfg


def check_exists(backend_path: str | None) -> None:
    if backend_path and not os.path.exists(backend_path):
        raise ConfigError(f"{backend_path}: no such file or folder")


def check_out_dir(path: str | None, flag: str = "--out") -> None:
    """Fail before any work when a folder the command may write into (--logs, --cache-dir, a socket's) cannot be
    made or written into; leaves nothing behind (report folders: repro.cli.outputs)."""

    if path is None:
        return
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path}: exists and is not a folder")
    check_writable(p, path, flag)


def check_file_and_folder(file: str | None, folder: str | None, file_flag: str = "--json", folder_flag: str = "--out"):
    """A report file and an output folder must be two paths: the folder would be made, then the file not written."""
    if file is not None and folder is not None and os.path.abspath(file) == os.path.abspath(folder):
        raise ConfigError(
            f"{file_flag} {file} and {folder_flag} {folder} are one path: {file_flag} takes a file, "
            f"{folder_flag} a folder"
        )


def poison_arg(text: str | None) -> str | None:
    """`none` and no poison mean the same case (no suffix in its id)."""

    p = parse_poison(text)
    return p.name if p else None


def gpu_present() -> bool:
    try:
        device_sm_count()
    except (Unavailable, OSError, subprocess.SubprocessError, ValueError):
        return False
    return True


_IMPORTED_AT = time.time()


def command_started_at() -> float:
    """When this process started (epoch s): from the kernel's process table where there is one (the interpreter's
    own start-up included), else when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def vllm_sources(paths: list[str]) -> dict[str, str]:
    """`vllm-check`'s sources judged before any is read: ConfigError (bad input, 2) for one that is no vLLM checkout
    or wheel; the wheels that begin as a zip but are cut short (damaged: untestable, 125), each with why."""
    damaged: dict[str, str] = {}
    for path in paths:
        check_exists(path)
        if os.path.isfile(os.path.join(path, "__init__.py")) and not os.path.isdir(os.path.join(path, "vllm")):
            raise ConfigError(f"{path}: the vllm package itself; name the folder that holds it ({Path(path).parent})")
        if os.path.isdir(path) and not os.path.isdir(os.path.join(path, "vllm")):  # as for a wheel: bad input
            raise ConfigError(f"{path}: not a vLLM checkout (no vllm/ package)")
        if os.path.isdir(path):
            continue
        if not path.endswith(".whl"):
            raise ConfigError(f"{path}: neither a vLLM checkout folder nor a wheel (.whl)")
        if not os.path.isfile(path):  # a device or a fifo named .whl: never read (it may not end)
            raise ConfigError(f"{path}: not a regular file, so not a wheel")
        if not zipfile.is_zipfile(path):
            if _zip_start(path):  # a zip cut short (no central directory): a damaged wheel, which judges nothing
                damaged[path] = "a zip archive cut short (no central directory)"
                continue
            raise ConfigError(f"{path}: not a wheel (not a zip archive)")
        with zipfile.ZipFile(path) as z:
            if not any(n.startswith("vllm/") for n in z.namelist()):
                raise ConfigError(f"{path}: not a vLLM wheel (no vllm/ package inside)")
    return damaged


def _zip_start(path: str) -> bool:
    """Whether the file begins as a zip archive does (a local file header)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False
