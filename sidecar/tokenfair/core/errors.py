"""The core's exceptions, in a module of their own: they subclass built-in exceptions other
than ``Exception``, which the compiled core (``tokenfair.native``, mypyc) cannot define, so
this module stays interpreted."""

from __future__ import annotations


class UnknownTenantError(KeyError):
    """The request names a tenant the configuration does not have."""


class DuplicateRequestError(ValueError):
    """A request id is already queued or running."""


class SimulationStuckError(RuntimeError):
    """Queued work that no future event can release (a policy bug, never an input error);
    raised by the replay (``tokenfair.sim.simulator``)."""
