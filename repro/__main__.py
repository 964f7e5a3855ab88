import signal
import sys

try:
    from repro.cli import main  # a Ctrl-C in these imports (or while the command line is parsed) is Ctrl-C too

    code = main()
except KeyboardInterrupt:  # before main's own handler: nothing was written yet
    sys.stderr.write("repro: interrupted\n")
    code = 130  # repro.exit_codes.Exit.INTERRUPTED, without importing it again
# The command decided its exit code: a Ctrl-C in the interpreter's teardown is held, never delivered, so that it cannot
# turn the answer into a death by SIGINT (-2: late in finalization Python gives SIGINT back its default action).
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
sys.exit(code)
