"""What judges a case: its process's records -> one verdict (classify, over the taxonomy of verdicts), the
expectation fixed before it runs (expectations), and the control policy (policy)."""
