"""Plots and written reports."""
