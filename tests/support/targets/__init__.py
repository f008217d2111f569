"""Rank bodies and rank scripts: module-level functions that spawned rank processes import
by name (``spawn_ranks``), and the scripts the tests start with ``python -m``."""
