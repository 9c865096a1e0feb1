"""Paged blocks <-> chunk copies. ``reference`` is plain torch and is the ground truth."""
