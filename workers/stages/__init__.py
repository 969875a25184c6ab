"""The stages around the engine, each with its rules (`<name>/rules.py`)."""
