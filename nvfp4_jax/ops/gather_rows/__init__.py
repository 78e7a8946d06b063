"""Row gathers with a fill (`gather_rows`): the mixture-of-experts layer's
token permutations."""
