"""What a gate run's cases checked, as the reports show it: each build's counters, captures per graph kind and per
capture manager, the configuration vLLM resolved and the draft's acceptance summed over its cases (`coverage`), and
each as a report's cell (`*_cell`). Read from the plugin's records (repro.vllm_integration.plugin.counters)."""

from __future__ import annotations

COUNTS = ("checks", "views_checked", "attention_forwards", "sched_calls", "sched_sm_margin", "fwd_sm_margin")
COUNTS += ("poison_calls", "entries_poisoned")
PER_KIND = ("captures", "captures_with_attention", "captures_audited", "captures_stale")
BY_MANAGER = ("captures_by_manager", "full_captures_by_manager", "injected_by_manager")  # plugin.counters
CONFIG = ("model_runner", "model_runner_v2", "attention_backend", "fa_version", "cudagraph_mode", "compilation_mode")
CONFIG += ("speculative_method", "num_speculative_tokens")


def coverage(pairs) -> dict:
    """What a build's cases checked: counters and acceptance summed, the configuration values seen (a set per key)."""
    counts: dict = {k: 0 for k in COUNTS}
    kinds: dict = {k: {} for k in PER_KIND}
    fa: dict = {}
    managers: dict = {}  # capture manager -> [captures, FULL captures, injected captures]
    config: dict = {k: [] for k in CONFIG}
    acc: dict = {}
    reported = 0
    for _, r in pairs:
        ident = r.backend_identity or {}
        c, e = ident.get("counters") or {}, ident.get("engine") or {}
        if not (c or e):
            continue
        reported += 1
        for k in COUNTS:
            counts[k] += int(c.get(k) or 0)
        for k in PER_KIND:
            for kind, n in (c.get(k) or {}).items():
                kinds[k][kind] = kinds[k].get(kind, 0) + n
        for v, n in (c.get("fa_versions") or {}).items():
            fa[v] = fa.get(v, 0) + n
        for i, name in enumerate(BY_MANAGER):
            for m, n in (c.get(name) or {}).items():
                managers.setdefault(m, [0] * len(BY_MANAGER))[i] += n
        for k in CONFIG:
            if e.get(k) is not None and e.get(k) not in config[k]:
                config[k].append(e.get(k))
        for k, v in (ident.get("acceptance") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                acc[k] = acc.get(k, 0) + v
            elif k == "unavailable":
                acc.setdefault(k, v)
    return {
        "cases_reporting": reported,
        **counts,
        **kinds,
        "fa_versions": fa,
        "managers": managers,
        "config": config,
        "acceptance": acc,
    }


def kinds_cell(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "0"


def captures_cell(c: dict) -> str:
    """captures per kind as `kind total/with attention/audited/stale`."""
    kinds = sorted(set(c.get("captures") or {}) | set(c.get("captures_audited") or {}))
    parts = []
    for k in kinds:
        nums = [(c.get(name) or {}).get(k, 0) for name in PER_KIND]
        parts.append(f"{k} {nums[0]}/{nums[1]}/{nums[2]}/{nums[3]}")
    return "; ".join(parts) or "none"


def config_cell(e: dict | None) -> str:
    if not e:
        return "-"
    runner = "V2" if e.get("model_runner_v2") else f"not V2 ({e.get('model_runner')})"
    backend = e.get("attention_backend") or "no hooked attention forward"
    if backend == "FLASH_ATTN":  # the FA version is FLASH_ATTN's alone
        fa = e.get("fa_version")
        backend += f" FA{fa if fa is not None else '?'}"
    return f"{runner}, {backend}, {e.get('cudagraph_mode')}, {e.get('speculative_method')} k={e.get('num_speculative_tokens')}"


def acceptance_cell(a: dict | None) -> str:
    if not a:
        return "-"
    if "unavailable" in a and len(a) == 1:
        return f"not exposed ({a['unavailable'][:60]})"
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    return ", ".join(f"{k.removeprefix('spec_decode_num_')} {a[k]}" for k in keys if k in a) or "-"
