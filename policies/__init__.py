"""Pure decisions: given facts, allow or refuse, naming the requirement and a reason.

Nothing in this package does I/O, reads a clock or talks to Docker.

    base        Decision, allow, deny
    status      AccessDecision (a Decision with an HTTP status), status_for
    chats       P1, P2   reply/react/edit/thread targets
    paths       P5       files sent, shared or attached
    shares      P6       revoking a share
    memory      M6-M8    memory targets, secrets in memory, budget banners; A2 archive
    secrets     K1, M8   what counts as a secret
    tools       T1-T4    MCP modules, offered tools, auto memory, narrate
    api_access  K2-K4    admin API key scope, host agent MCP keys
    cron        C1, C2   creating and running cron jobs
    persona     L6       persona files are operator-only
    lifecycle   L5, A3   restart on a mode change, dreaming under isolation
"""

from policies.base import Decision, allow, deny

__all__ = ["Decision", "allow", "deny"]
