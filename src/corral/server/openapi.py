"""Print ``corral serve``'s OpenAPI document (``python -m corral.server.openapi``), as the
server serves it at ``/openapi.json``; docs/openapi.json is this output, checked by a test."""

from __future__ import annotations

import json
import sys
from typing import Any

from corral.cli.run import parse_run_args
from corral.server.api import build_api
from corral.server.boxes import Boxes, ServeLimits
from corral.server.metrics import Metrics


def document() -> dict[str, Any]:
    metrics = Metrics()
    app = build_api(Boxes(ServeLimits(), metrics), metrics, info={}, parse_run=parse_run_args)
    return app.openapi()


def main() -> None:
    json.dump(document(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
