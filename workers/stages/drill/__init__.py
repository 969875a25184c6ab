"""A canary made bad on purpose, for rollback drills."""
