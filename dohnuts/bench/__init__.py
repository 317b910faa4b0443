"""Measurements: workloads, roofline, telemetry, named shapes, load generation, the figures ledger."""
