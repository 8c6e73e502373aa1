"""Rendering only: console tables and plots of plans, profiles and evaluations."""
