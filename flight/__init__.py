"""Onboard side: the resumable VLM engine, its checkpoints and recovery, and the payload process."""
