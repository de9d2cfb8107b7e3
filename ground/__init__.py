"""Ground segment: operator CLI and the authenticated link client."""
