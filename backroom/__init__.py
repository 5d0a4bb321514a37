"""backroom."""
