"""Clients of ``corral serve``.

- :mod:`corral.client.remote`: the remote SDK (``corral.connect``), with the library's API;
- :mod:`corral.client.cli`: the CLI's commands through a server (stdlib only);
- :mod:`corral.client.fast`: finding the server and talking HTTP to it (stdlib only);
- :mod:`corral.client.frames`: the byte stream of a command's output.
"""
