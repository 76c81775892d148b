"""Engine server (placeholder until implemented)."""
