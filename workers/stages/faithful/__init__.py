"""Faithfulness: length caps and checks, a suspect translation retried."""
