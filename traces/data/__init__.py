"""Shipped interruption traces (*.jsonl); a package only so that wheels include the files."""
