"""What runs a case: one process per case (runner), how case processes start (executor, server, process), SM
restriction and the MPS cases (smcontrol, mps_cases), memcheck (sanitizer), one GPU per pytest worker
(pinning, pytest_cases), and the structured channel a case's records come back on (channel, tags)."""
