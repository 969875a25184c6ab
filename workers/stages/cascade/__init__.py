"""Cascade: the small model answers, the large model only where the small one is likely wrong."""
