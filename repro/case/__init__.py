"""What a case is: CaseSpec and CaseResult (spec), the attention shape and capture plan (descriptors), the
scenarios and their pass sequences, the poison fills, and the case sets: the matrix's (matrix) and the
pytest GPU tier's (sets)."""
