"""preshard's benchmarks: each one prints a table and writes `benchmarks/results/<name>.json`."""
