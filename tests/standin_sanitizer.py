"""Stand-in for compute-sanitizer in the WarmPool tests: takes its `--option value` pairs, starts its log where
--log-file says, adds injection variables to the program's environment (as the real one does), runs the program, and ends the log with its ERROR SUMMARY."""

import os
import subprocess
import sys

args = sys.argv[1:]
opts = {}
while args and args[0].startswith("--"):
    opts[args[0]], args = args[1], args[2:]
with open(opts["--log-file"], "w") as f:
    f.write("========= COMPUTE-SANITIZER\n")
env = {**os.environ, "NV_SANITIZER_STANDIN": "injected", "STANDIN_SANITIZER_LOG": opts["--log-file"]}
code = subprocess.call(args, env=env)
with open(opts["--log-file"], "a") as f:  # as memcheck ends its log once the program ended
    f.write("========= ERROR SUMMARY: 0 errors\n")
sys.exit(code)
