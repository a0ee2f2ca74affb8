"""pytest plugin (entry point `pytest11`): helpers for "patched equals unpatched" tests."""
