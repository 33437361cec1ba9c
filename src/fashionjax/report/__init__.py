"""Figures and the HTML report, built from a run's saved artifacts only (no JAX, no training code)."""
