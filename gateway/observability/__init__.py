"""Prometheus metrics, OpenTelemetry traces and request logs."""
