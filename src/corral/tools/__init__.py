"""Agent tools: the spec's tool contract, with capabilities, approvals, secrets and scopes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from corral._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    from corral.tools.approvals import (
        DEFAULT_RULES,
        ApprovalRequest,
        Approver,
        Gate,
        PermissionMode,
        Rule,
        Verdict,
    )
    from corral.tools.catalog import TOOLS, ToolSpec
    from corral.tools.results import ToolError, ToolResult
    from corral.tools.scopes import Scope
    from corral.tools.secrets import SecretStore
    from corral.tools.toolbox import Toolbox, allowed_tools, tool_schemas

_LAZY: dict[str, str] = {
    "ApprovalRequest": "corral.tools.approvals",
    "Approver": "corral.tools.approvals",
    "DEFAULT_RULES": "corral.tools.approvals",
    "Gate": "corral.tools.approvals",
    "PermissionMode": "corral.tools.approvals",
    "Rule": "corral.tools.approvals",
    "Scope": "corral.tools.scopes",
    "SecretStore": "corral.tools.secrets",
    "TOOLS": "corral.tools.catalog",
    "ToolError": "corral.tools.results",
    "ToolResult": "corral.tools.results",
    "ToolSpec": "corral.tools.catalog",
    "Toolbox": "corral.tools.toolbox",
    "Verdict": "corral.tools.approvals",
    "allowed_tools": "corral.tools.toolbox",
    "tool_schemas": "corral.tools.toolbox",
}
"""Public name -> the module defining it, imported on first use."""

__all__ = [
    "DEFAULT_RULES",
    "TOOLS",
    "ApprovalRequest",
    "Approver",
    "Gate",
    "PermissionMode",
    "Rule",
    "Scope",
    "SecretStore",
    "ToolError",
    "ToolResult",
    "ToolSpec",
    "Toolbox",
    "Verdict",
    "allowed_tools",
    "tool_schemas",
]

__getattr__ = lazy_getattr(globals(), _LAZY)
__dir__ = lazy_dir(globals())
