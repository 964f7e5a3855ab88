"""Stale FA3 attention-metadata reproducer and regression harness (`python -m repro --help`)."""

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("repro-stale-metadata")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0.1.0"
