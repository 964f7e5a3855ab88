"""vLLM builds and releases, read without a GPU: which builds a gate run tests (builds), the source check,
a tree's or wheel's plugin facts (compat), the version table (versions), git bisect, the affected range."""
