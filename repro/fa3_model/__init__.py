"""CPU models of FA3: the scheduler metadata it computes (scheduler.py) and what its kernels read (reads.py)."""
