"""Runnable models, expressed as a sequence of units (see `units.py`)."""
