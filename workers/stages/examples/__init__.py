"""Retrieved translation-memory examples in the prompt."""
