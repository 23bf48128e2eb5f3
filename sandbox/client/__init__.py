"""The in-sandbox clients: `cellgate-tool` and `cellgate-mcp`, stdlib only (Python 3.8+).

They are copied into each bridge directory and run from there, so neither
imports the other by package name.
"""
