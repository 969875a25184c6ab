"""The exact-match translation cache: L1 in memory, L2 in Redis."""
