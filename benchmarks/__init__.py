"""GeRL's benchmarks: one script per measurement; `python -m benchmarks` lists them and runs one."""
