"""The bubblewrap backend: :mod:`.box` starts and tears down boxes (``BwrapBackend``),
:mod:`.args` renders the shared layout as bwrap's command line."""
