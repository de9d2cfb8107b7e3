"""Importers that turn real satellite telemetry into interruption traces."""
