"""The OCI backend (runc, crun, runsc): :mod:`.box` drives the runtime (``OciBackend``),
:mod:`.config` renders the shared layout as the bundle's config.json."""
