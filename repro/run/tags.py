"""Moved to repro.contract.tags (the bottom contract layer); this name stays for code that still imports it here: it
is that very module (sys.modules), so an attribute set through either name is seen through both."""

import sys

from repro.contract import tags as _moved

sys.modules[__name__] = _moved
