"""What reports it: the matrix's reports (results), the environment every report shows, redaction of machine
paths, the pytest gate's report, benchmarks, and the xdist report."""
