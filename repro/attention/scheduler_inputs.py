"""Moved to repro.backends.scheduler_inputs (below the layers that read it); this name stays for code that still imports it here:
it is that very module (sys.modules), so an attribute set through either name is seen through both."""

import sys

from repro.backends import scheduler_inputs as _moved

sys.modules[__name__] = _moved
