"""Device code: one kernel family per module, one kernel class per file."""
