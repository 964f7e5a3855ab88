"""vLLM integration: the capture-time freshness auditor (a vLLM plugin), source checks, bisect, the end-to-end gate."""
