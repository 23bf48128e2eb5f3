"""cellgate's lowest floor: the error tree and its own message models.

Every other package (`sandbox`, `channels`, `policies`, `orchestrator`) may
import from here; nothing here imports any of them.
"""
