"""What tests/ and tools/ share: bitwise comparison, matmul-only models, cuda probes, reports.
Not installed with the package."""
