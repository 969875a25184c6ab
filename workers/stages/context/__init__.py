"""Conversation context: the turns before, in the prompt."""
