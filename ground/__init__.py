"""Ground segment: operator CLI (`ow ground ...`) and the authenticated link client.

In-process use: `ground.client.GroundClient` (see docs/ground.md)."""
