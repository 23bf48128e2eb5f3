"""Sandbox backends: one contract (`base.SandboxBackend`), one module per engine."""
