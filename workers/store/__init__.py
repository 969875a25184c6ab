"""The Redis result store, and the writes kept for later while Redis is down."""
