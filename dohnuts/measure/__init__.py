"""Measurement: roofline work counts, device ceilings and telemetry, named model shapes."""
