"""Recipes that build the bundled models on the CPU (nothing is downloaded)."""
