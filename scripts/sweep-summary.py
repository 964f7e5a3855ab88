"""Summarise a folder of matrix runs (each DIR/<name>/results.json written by `python -m repro matrix --out`): one row
per run with its verdict counts and unexpected cases, then every launch failure with the line that reported it and
its log's path. Used by scripts/gpu-evidence.sh launch-sweep; reads only what the harness wrote."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repro.contract.verdicts import LAUNCH_FAIL  # noqa: E402
from repro.report.results import load_json  # noqa: E402


def main(folder: str) -> int:
    runs = sorted(Path(folder).glob("*/results.json"))
    if not runs:
        print(f"no results.json under {folder}", file=sys.stderr)
        return 4
    lines = ["# Launch-failure sweep", "", "| run | cases | verdicts | unexpected |", "|---|---|---|---|"]
    launch = []
    for path in runs:
        run = load_json(path)
        counts = Counter(r.verdict for _, r in run.results)
        fails = run.failures()
        lines.append(
            f"| {path.parent.name} | {len(run.results)} | {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))} | "
            f"{len(fails)} |"
        )
        launch += [(path.parent.name, s, r) for s, r in run.results if r.verdict == LAUNCH_FAIL]
    lines += ["", f"## Launch failures ({len(launch)})", ""]
    lines += [f"- {name} `{s.case_id}` (expected {r.expected}, kernel {r.kernel or 'not attributed'}): {r.reason}"
              for name, s, r in launch]  # fmt: skip
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
