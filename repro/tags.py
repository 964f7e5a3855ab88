"""The line tags a case process prints and its parent parses (`<TAG> <json>` on one line). One home for the
attention-layer worker, the vLLM gate process and the runner that reads both."""

PASS_TAG = "REPRO_PASS"  # before every launch: which descriptor runs next
RESULT_TAG = "REPRO_RESULT"  # once, at the end: what the case produced
SKIP_TAG = "REPRO_SKIP"  # the case cannot run here, and why
DEVICE_TAG = "REPRO_DEVICE"  # the GPU (and SMs) the process sees
