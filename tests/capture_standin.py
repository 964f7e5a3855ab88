"""torch.cuda.graph's stand-in for the plugin's CPU tests (not collected: no test_ prefix): it says when a capture is
open, so a test can forbid what a capture forbids (a copy of a view to the host) while one is."""

from __future__ import annotations


class GraphStandIn:
    """torch.cuda.graph's stand-in: `open` while a capture is."""

    open = False

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        GraphStandIn.open = True

    def __exit__(self, *exc):
        GraphStandIn.open = False
        return False
