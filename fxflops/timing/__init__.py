"""The measuring side: wall-clock latency per module, profile() and profile_generate() that join it to the counts, and the training meter (FlopsMeter)."""
