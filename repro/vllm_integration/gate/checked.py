"""What a gate run's cases checked, as the reports show it: each build's counters, captures per graph kind and per
capture manager, the configuration vLLM resolved and the draft's acceptance summed over its cases (`coverage`), and
each as a report's cell (`*_cell`). Read from the plugin's records (repro.vllm_integration.plugin.counters).

What the replay check and the refresh judging judged (`judged`, shared with `repro audit`'s report): replays judged
and left unjudged (with the most common reason), refreshed fields judged, stale and left unjudged, or the check off
with its reason. A check that judged nothing says "0 judged", never clean: a PASS does not say replays were
checked."""

from __future__ import annotations

from repro.vllm_integration.plugin.replay import NO_BUILD, OTHER_GRAPH

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
        **judged([(r.backend_identity or {}).get("counters") or {} for _, r in pairs]),
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


RAISED_AT_REPLAY = "the check raised at a replay"  # plugin.replay.guarded's reason at the replay hook


def _top(d: dict) -> tuple[str, int] | None:
    return max(sorted(d.items()), key=lambda kv: kv[1]) if d else None


def _states(counters: list[dict], key: str) -> dict[str, int]:
    """How many of the reports had the check `key` in each state ("on", or why it was off); None (not reported) left out."""
    out: dict[str, int] = {}
    for c in counters:
        if c.get(key) is not None:
            out[str(c[key])] = out.get(str(c[key]), 0) + 1
    return out


def _sum(counters: list[dict], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counters:
        for k, n in (c.get(key) or {}).items():
            out[k] = out.get(k, 0) + int(n or 0)
    return out


def _off_words(what: str, states: dict[str, int], n: int) -> str:
    why = "; ".join(k.removeprefix("off: ") for k in sorted(states) if k != "on")
    return f"{what} off: {why}" + (f" (in {n} of {sum(states.values())} reports)" if n != sum(states.values()) else "")


def _words(what: str, states: dict[str, int], body: str, top: tuple | None, extra: str = "") -> str:
    """A check's words: not reported, off (why), or what it judged (`body`), its most frequent unjudged reason, what
    else it left (`extra`), and the reports where it was off."""
    off = sum(n for k, n in states.items() if k != "on")
    if not states:
        return f"{what} not reported"
    if not states.get("on"):
        return _off_words(what, states, off)
    words = body + (f" (most: {top[0]}: {top[1]})" if top else "") + extra
    return words + (f"; {_off_words(what, states, off)}" if off else "")


def judged(counters: list[dict]) -> dict:
    """What the replay check and the refresh judging judged, summed over reports (one per case or process): counts,
    unjudged by reason (the replays' reasons apart from views no build wrote) and their words (`replay`, `refresh`)."""
    states = _states(counters, "replay_check")
    seen, checks = (sum(int(c.get(k) or 0) for c in counters) for k in ("replays_seen", "replay_checks"))
    why = _sum(counters, "replay_unjudged")
    per_replay = {k: n for k, n in why.items() if k in (NO_BUILD, OTHER_GRAPH) or k.startswith(RAISED_AT_REPLAY)}
    views = {k: n for k, n in why.items() if k not in per_replay}
    replay = {"check": states, "seen": seen, "judged": checks, "unjudged": sum(per_replay.values())}
    replay |= {"unjudged_by_reason": per_replay, "views_unjudged": views, "top_reason": (_top(per_replay) or [None])[0]}
    body = f"{checks} judged of {seen} replays seen" + (" (nothing checked at replay)" if not checks else "")
    body += f", {replay['unjudged']} sampled and left unjudged"
    extra = f", {sum(views.values())} view(s) no build wrote" if views else ""
    words = _words("replay check", states, body, _top(per_replay), extra)
    replay["words"] = words
    r_states, stale = _states(counters, "refresh_judging"), sum(int(c.get("refresh_stale") or 0) for c in counters)
    r_checks = sum(int(c.get("refresh_checks") or 0) for c in counters)
    r_why = _sum(counters, "refresh_unjudged")
    r_inputs = sum(int(c.get("refresh_input_checks") or 0) for c in counters)  # what the refresh handed FA3
    refresh = {"judging": r_states, "judged": r_checks, "stale": stale, "unjudged": sum(r_why.values())}
    refresh |= {"unjudged_by_field": r_why, "top_reason": (_top(r_why) or [None])[0], "inputs_judged": r_inputs}
    body = f"{r_checks} refreshed field(s) judged" + (f" and {r_inputs} input(s)" if r_inputs else "")
    body += " (no refresh judged)" if not r_checks and not r_inputs else ""
    body += f", {stale} stale, {refresh['unjudged']} unjudged"
    words = _words("refresh judging", r_states, body, _top(r_why))
    refresh["words"] = words
    return {"replay": replay, "refresh": refresh}


def judged_cell(cov: dict) -> str:
    """The replay check's words and the refresh judging's, for a report's cell."""
    return f"replay: {cov['replay']['words']}; refresh: {cov['refresh']['words']}"
