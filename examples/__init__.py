"""Example training programs (models + seeded input factories)."""
