"""Interruption traces: format, loader, validator, physical generator and telemetry importer."""
