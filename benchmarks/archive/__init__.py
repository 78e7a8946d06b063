"""Finished experiments, kept because BENCHMARKS.md and docs/journal.md
cite their measurements (see README.md here)."""
