"""Protected spans: masked before translation, restored after."""
