"""Measured per-rank timelines: trace files the runtime writes (`events`), their analysis (`render`)."""
