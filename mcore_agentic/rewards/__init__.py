"""Rule-based reward functions selected by data_source."""
