"""Experiment orchestration: Ray Train/Tune launching, MLflow tracking and reports."""
