import signal
import sys

from repro.cli import main

code = main()
# The command decided its exit code: a Ctrl-C in the interpreter's teardown is held, never delivered, so that it cannot
# turn the answer into a death by SIGINT (-2: late in finalization Python gives SIGINT back its default action).
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
sys.exit(code)
