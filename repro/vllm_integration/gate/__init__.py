"""The vLLM gate: what a gate case is (case), its process (worker: vLLM's V2 runner on a tiny model), how it
is judged (judge, coverage), run (run, placement, cache, bench; launch, fork: how its processes start;
paths: --compare-paths) and reported (report)."""
