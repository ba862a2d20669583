"""The kit's Python: mod engine, pins, scheduler harness, model lock, bench, report."""
