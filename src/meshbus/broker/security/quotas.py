"""What one user may hold on one broker: its ``[users.quotas]`` (docs/security.md,
"Per-user quotas").

The broker's other limits are per link (--max-services, --max-groups, --max-requests)
or per broker (--max-connectors, --max-operators): one user with many links could take
all of them, and leave the broker full for everyone else. A user's quotas bound the
sum over all its links on the broker. Reading a table here; counting what a user holds
is meshbus.broker.core.usage's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshbus.errors import InvalidArgument

# A quota's largest value: far above what any broker holds, and still a plain int.
MAX_QUOTA = 1 << 62
# The keys of [users.quotas], the fields of Quotas.
CONNECTIONS, SERVICES, MEMBERSHIPS, REQUESTS, STREAM_BYTES = (
    "connections",
    "services",
    "memberships",
    "requests",
    "stream_bytes",
)
QUOTA_KEYS = (CONNECTIONS, SERVICES, MEMBERSHIPS, REQUESTS, STREAM_BYTES)


class BadQuotas(InvalidArgument):
    """A ``quotas`` table the broker cannot use; the message names the user and the key,
    and ``key`` is that key's path (``quotas.services``)."""

    def __init__(self, message: str, key: str = "quotas") -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Quotas:
    """One user's quotas on one broker; each key of ``[users.quotas]`` is a field. The
    defaults let one user hold far more than an application needs, and still far less
    than what fills a broker: 64 links of the default 50 --max-connectors would be one
    user's, so set ``connections`` lower where several users share a broker."""

    # Connector and operator links open at once.
    connections: int = 64
    # Services registered, over all the user's links.
    services: int = 100_000
    # Group memberships of the user's services (about 740 bytes each).
    memberships: int = 100_000
    # Requests made over the user's links waiting for a response.
    requests: int = 65_536
    # The max_bytes of the streams the user's links added to this broker, together;
    # None: no quota (--max-store-bytes bounds every stream's bytes together).
    stream_bytes: int | None = None

    @classmethod
    def from_table(cls, table: object, user: str) -> Quotas:
        """The quotas of ``user`` from its ``quotas`` table; a key it leaves out keeps
        its default. BadQuotas names the user and the key."""
        if not isinstance(table, Mapping):
            raise BadQuotas(f"user {user!r}: quotas is a table, not {table!r}")
        values: dict[str, int] = {}
        for key, value in table.items():
            if key not in QUOTA_KEYS:
                raise BadQuotas(
                    f"user {user!r}: unknown key quotas.{key} (the keys are "
                    f"{', '.join(QUOTA_KEYS)})",
                    f"quotas.{key}",
                )
            if isinstance(value, bool) or not isinstance(value, int):
                raise BadQuotas(
                    f"user {user!r}: quotas.{key} is a whole number, not {value!r}",
                    f"quotas.{key}",
                )
            if not 0 <= value <= MAX_QUOTA:
                raise BadQuotas(
                    f"user {user!r}: quotas.{key} is {value}; it is 0 to {MAX_QUOTA}",
                    f"quotas.{key}",
                )
            values[key] = value
        return cls(**values)
