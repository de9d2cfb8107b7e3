"""Imported by zygote_probe: a module only a payload loads, never the zygote."""
