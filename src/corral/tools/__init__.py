"""Agent tools: the spec's tool contract, with capabilities, approvals, secrets and scopes."""

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
