"""Renderings of a Result: JSON schema, terminal tables, CSV, plots, HTML."""
