"""Small shared utilities (timing, logging, seeding)."""
