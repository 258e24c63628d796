"""Counting, logging and auditing: metrics, log handlers, outcomes; memory housekeeping."""
