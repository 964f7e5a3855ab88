"""What MPS clients see when a neighbour faults: stale memcheck cases as ONE batch of concurrent clients under one
MPS daemon (what repro.run.mps_cases never does for cases that may fault), with every client's log kept.
On the device: python3 scripts/mps-neighbour-faults.py OUTDIR  (prints one verdict line per client)."""

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro.case.matrix import MatrixOptions, build_specs  # noqa: E402
from repro.run.runner import run_case  # noqa: E402
from repro.run.smcontrol import MpsDaemon  # noqa: E402

out = Path(sys.argv[1])
logs = out / "logs"
specs = build_specs(MatrixOptions(strategies=("stale",), sms=("mps:16",), sanitizer=True, timeout_s=90))
with MpsDaemon() as daemon, ThreadPoolExecutor(max_workers=len(specs)) as pool:
    results = list(pool.map(lambda s: run_case(s, logs, daemon), specs))
keep = out / "kept"
keep.mkdir(parents=True, exist_ok=True)
kept_verdicts: set[str] = set()
for s, r in zip(specs, results):
    print(f"{r.verdict:<15} {s.case_id}: {r.reason[:220]}")
    # not the client's own memcheck finding: what reached it from a neighbour. One output log per verdict (the
    # device brings back 8 files a call; the memcheck logs are large)
    if r.verdict != "oob" and r.verdict not in kept_verdicts:
        kept_verdicts.add(r.verdict)
        shutil.copy(logs / f"{s.case_id}.out.log", keep / f"{r.verdict}.{s.case_id}.out.log")
