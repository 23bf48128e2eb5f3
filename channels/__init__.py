"""Platform adapters: each turns library objects into cellgate's own models (`channels.base`)."""
