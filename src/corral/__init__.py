"""corral: run AI agents commands inside Linux sandboxes."""
