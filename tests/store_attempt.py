"""``StoreAttempt``: an attempt in flight as ``FailoverStore`` needs it (its
``AttemptInFlight`` protocol), for tests that drive a store without a proxy."""

from __future__ import annotations

from dataclasses import dataclass

from turnguard_core import identity


@dataclass
class StoreAttempt:
    ident: identity.Identity
    attempt_id: int | None
    generation: str
    kind: str = "original"
    flow_id: str = "f"
    method: str = "POST"
    route: str = "/v1/responses"
    circuit_scope: str = "route:x"
    transport: str = "http"
