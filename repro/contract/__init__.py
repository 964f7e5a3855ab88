"""The contract every layer exchanges, at the bottom of the layers: the channel records a case process writes and its
parent reads (channel), their tags (tags), the verdict words a case can get (verdicts). It imports nothing of repro
above it, so a case process, the plugin inside vLLM and the judges all import it without reaching up."""
