#!/usr/bin/env python3
"""The auditor's overhead on a person's script: the same command run N times plain and N times under `repro audit`,
alternating, each wall time measured; prints one JSON line (plain and audited seconds, their medians, the ratio).

    python scripts/audit_examples/overhead.py --runs 3 --out OUT -- python scripts/audit_examples/user_script.py"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", required=True, help="a new folder: each audited run's report folder goes under it")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    a = p.parse_args()
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    Path(a.out).mkdir(parents=True)
    plain, audited, codes = [], [], []
    for i in range(a.runs):
        t = time.time()
        codes.append(subprocess.run(argv).returncode)
        plain.append(round(time.time() - t, 2))
        t = time.time()
        cmd = [sys.executable, "-m", "repro", "audit", "--out", f"{a.out}/run-{i}", "--", *argv]
        codes.append(subprocess.run(cmd).returncode)
        audited.append(round(time.time() - t, 2))
    doc = {"plain_s": plain, "audited_s": audited, "exit_codes": codes, "plain_median_s": statistics.median(plain),
           "audited_median_s": statistics.median(audited),
           "ratio": round(statistics.median(audited) / statistics.median(plain), 3)}  # fmt: skip
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
