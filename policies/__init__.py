"""Pure decisions: given facts, allow or refuse, naming the requirement and a reason.

Nothing in this package does I/O, reads a clock or talks to Docker.
"""

from policies.base import Decision, allow, deny

__all__ = ["Decision", "allow", "deny"]
