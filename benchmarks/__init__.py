"""gradtx benchmarks: one module per capability; `python -m benchmarks`."""
