"""Stale FA3 attention-metadata reproducer and regression harness (`python -m repro --help`)."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent  # this folder, repro/: the same for every module, however deep it sits
CHECKOUT = PACKAGE.parent  # the folder that holds repro/: first on a case process's PYTHONPATH

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("repro-stale-metadata")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0.1.0"
