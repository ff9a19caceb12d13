"""``corral serve``: a resident server that holds boxes and serves them over HTTP.

- :mod:`corral.server.transport`: uvicorn's h11 with bounded heads and connections, unix
  sockets for their owner only, token files (shared with ``corral mcp --http``);
- :mod:`corral.server.auth`: bearer tokens with scopes, Host and Origin checks;
- :mod:`corral.server.boxes`: the boxes the server holds (TTL, idle timeout, start cap,
  warm pools per policy) and their reaper;
- :mod:`corral.server.api`: the HTTP API (FastAPI), its models and the OpenAPI document.

The remote SDK and the CLI's fast path that talk to it are in :mod:`corral.client`.
"""
