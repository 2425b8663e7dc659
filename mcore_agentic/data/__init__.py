"""Parquet RL datasets, batch containers and collation."""
