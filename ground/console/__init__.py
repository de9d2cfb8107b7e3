"""`ow ground console`: a live web console for ground operators (docs/ground.md "Console").

    server.py    the aiohttp application: pages, JSON views, the server-sent event stream, actions
    history.py   bounded, decimated history of what the telemetry link delivered
    command_log.py  reading the station's command log (the history view, `ow ground commands`)
    security.py  bind rules, token, same-origin check, TLS (given or self-signed)
    static/      the page, its script and style, and the vendored uPlot (MIT)

The console is a ground client like the CLI: it commands the payload only through
`ground.client.GroundClient`, with the station's keys.
"""

from ground.console.history import History
from ground.console.security import ConsoleSecurity, SecurityError
from ground.console.server import ConsoleConfig, make_app

__all__ = ["ConsoleConfig", "ConsoleSecurity", "History", "SecurityError", "make_app"]
