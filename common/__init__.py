"""Shared by every OrbitWeaver component: record format, durable I/O, wire protocol, logging, CLI root."""
