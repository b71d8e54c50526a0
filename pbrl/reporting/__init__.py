"""Reporting: run metrics, evaluation statistics, the report figure and reward histograms."""
