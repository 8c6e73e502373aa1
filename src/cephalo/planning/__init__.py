"""Specs -> Plan: the cost model (every formula, once), the planner and its baselines, the
Plan value and its JSON, and the cost model's sources (catalog or measured profiles)."""
