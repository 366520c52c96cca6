"""Engines: functions that turn a plain Hugging Face model and a ParallelPlan into a frozen, sharded model."""
