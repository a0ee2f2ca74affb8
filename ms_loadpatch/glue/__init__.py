"""Wrappers that hook the loading strategy into mindone (one module per library, and what they share)."""
