"""The line tags a case process prints and its parent parses (`<TAG> <json>` on one line). One home for the
attention-layer worker, the vLLM gate process and the runner that reads both."""

PASS_TAG = "REPRO_PASS"  # before every launch: which descriptor runs next
RESULT_TAG = "REPRO_RESULT"  # once, at the end: what the case produced
# an attention-layer RESULT's key: the descriptor of the first pass that ran on metadata differing from a fresh build
# (typed where the difference is found, never split out of a difference's words)
FIRST_STALE = "first_stale_descriptor"
SKIP_TAG = "REPRO_SKIP"  # the case cannot run here, and why
DEVICE_TAG = "REPRO_DEVICE"  # the GPU (and SMs) the process sees
# The vLLM gate (repro.vllm_integration): what the plugin inside vLLM and the gate case process report.
PLUGIN_TAG = "REPRO_PLUGIN"  # a plugin feature installed, or an install error ({"error": ...})
AUDIT_TAG = "REPRO_AUDIT"  # the freshness auditor: stale views found, and its summary at exit
COUNTERS_TAG = "REPRO_COUNTERS"  # the plugin's counters (captures per graph kind, checks, hook calls), at exit
ENGINE_TAG = "REPRO_ENGINE"  # the engine's resolved configuration, the counters and acceptance, after generate
TAGS = (
    PASS_TAG,
    RESULT_TAG,
    SKIP_TAG,
    DEVICE_TAG,
    PLUGIN_TAG,
    AUDIT_TAG,
    COUNTERS_TAG,
    ENGINE_TAG,
)  # repro.contract.channel
