"""What each signed-in user holds on this broker, against its quotas (docs/security.md,
"Per-user quotas"; the quotas themselves are meshbus.broker.security.quotas).

A user's links are recorded here, as they open and close, and the streams its links
added. Services and memberships are summed over those links from the routing table,
so they can never drift from what the broker holds, at one lookup per link of the
user (at most its ``connections`` quota) on a REGISTER or JOIN. Requests are on the
data path, so they are one int: the user's ``Tally``, which the pending table keeps
in step with its entries (meshbus.broker.core.pending).

The quotas are read from the users of the moment (``users``), so a reload (SIGHUP)
applies to what a user asks for next; what it holds already is kept, even above a
lowered quota. A broker without users has no user identity: its links have no user,
and only the per-link and per-broker limits apply.
"""

from __future__ import annotations

from collections.abc import Callable

from meshbus.broker.core.dispatch import Refused
from meshbus.broker.core.endpoint import Endpoint
from meshbus.broker.core.link import Link
from meshbus.broker.core.pending import Tally
from meshbus.broker.core.routing import RoutingTable
from meshbus.broker.security.quotas import (
    CONNECTIONS,
    MEMBERSHIPS,
    QUOTA_KEYS,
    REQUESTS,
    SERVICES,
    STREAM_BYTES,
    Quotas,
)
from meshbus.broker.security.users import UserTable
from meshbus.protocol.layout import ErrorCode

# What each quota counts, as a refusal says it ("user 'x' already has 3 ...").
_WHAT = {
    CONNECTIONS: "links open to this broker",
    SERVICES: "services registered on this broker",
    MEMBERSHIPS: "group memberships on this broker",
    REQUESTS: "requests waiting for a response on this broker",
    STREAM_BYTES: "bytes of streams (their max_bytes) added to this broker",
}
# What to do about a refusal.
_ADVICE = {
    CONNECTIONS: "close one first",
    SERVICES: "unregister some first",
    MEMBERSHIPS: "leave some groups first",
    REQUESTS: "wait for some responses first",
    STREAM_BYTES: "delete a stream first, or add this one with a smaller max_bytes",
}


class QuotaExceeded(Refused):
    """A request past its user's quota: ERROR LIMIT_EXCEEDED, the link stays open."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.LIMIT_EXCEEDED, message)


class UserUsage:
    """One user's links open on this broker, and the streams they added here."""

    __slots__ = ("links", "requests", "streams", "user")

    def __init__(self, user: str) -> None:
        self.user = user
        self.links: set[Link] = set()
        self.requests = Tally()  # requests of its links waiting for a response
        self.streams: dict[str, int] = {}  # stream name -> its max_bytes

    def __bool__(self) -> bool:
        return bool(self.links or self.streams or self.requests.count)


class UsageTable:
    def __init__(
        self,
        users: Callable[[], UserTable],
        routing: RoutingTable[Endpoint],
    ) -> None:
        """``users``: the broker's users of the moment (a reload replaces them)."""
        self._users = users
        self._routing = routing
        self._usage: dict[str, UserUsage] = {}
        self._stream_adders: dict[str, UserUsage] = {}  # stream name -> who added it

    def quotas_of(self, user: str) -> Quotas:
        entry = self._users().get(user)
        return entry.quotas if entry is not None else Quotas()

    def used(self, user: str, key: str) -> int:
        """How much of quota ``key`` ``user`` holds on this broker now."""
        usage = self._usage.get(user)
        if usage is None:
            return 0
        links = usage.links
        if key == CONNECTIONS:
            return len(links)
        if key == SERVICES:
            return sum(map(self._routing.owned_count, links))
        if key == MEMBERSHIPS:
            return sum(map(self._routing.memberships_of, links))
        if key == REQUESTS:
            return usage.requests.count
        return sum(usage.streams.values())

    def refusal(self, user: str, key: str, more: int = 1) -> str:
        """Why ``user`` may not take ``more`` of quota ``key`` ("" when it may)."""
        limit = getattr(self.quotas_of(user), key)
        if limit is None:
            return ""
        used = self.used(user, key)
        if used + more <= limit:
            return ""
        return (
            f"limit exceeded: user {user!r} already has {used} {_WHAT[key]}, and its quota is "
            f"{limit} (quotas.{key} of its [[users]] entry in the broker's config); "
            f"{_ADVICE[key]}"
        )

    def tally_for_request(self, user: str) -> Tally | None:
        """The tally one more request of ``user`` counts in while it waits; None when the
        user has its quota of requests waiting (the request is refused)."""
        usage = self._usage.get(user)
        if usage is None:  # never: a user's link is recorded as it opens
            usage = self._usage[user] = UserUsage(user)
        tally = usage.requests
        return tally if tally.count < self.quotas_of(user).requests else None

    def check(self, user: str | None, key: str, more: int = 1) -> None:
        """QuotaExceeded when ``user`` may not take ``more`` of quota ``key``; nobody (a
        link without a user: a broker without users) has no quota."""
        if user:
            refusal = self.refusal(user, key, more)
            if refusal:
                raise QuotaExceeded(refusal)

    # -- what is recorded -------------------------------------------------------------

    def link_opened(self, link: Link) -> None:
        """A signed-in link opened (its ``connections`` quota checked first)."""
        user = link.user
        if user is not None:
            usage = self._usage.get(user)
            if usage is None:
                usage = self._usage[user] = UserUsage(user)
            usage.links.add(link)

    def link_closed(self, link: Link) -> None:
        user = link.user
        usage = self._usage.get(user) if user is not None else None
        if usage is not None:
            usage.links.discard(link)
            self._forget_if_idle(usage)

    def stream_added(self, owner: str, name: str, max_bytes: int) -> None:
        """The stream ``name`` of ``owner`` ("" for nobody's) is hosted here: added now
        (``stream_bytes`` checked first), or read back from the store at start -- what a
        user's streams hold counts against its quota across restarts."""
        if owner:
            usage = self._usage.get(owner)
            if usage is None:
                usage = self._usage[owner] = UserUsage(owner)
            usage.streams[name] = max_bytes
            self._stream_adders[name] = usage

    def stream_deleted(self, name: str) -> None:
        """The stream ``name`` is gone, whoever deleted it: its adder's bytes come back."""
        usage = self._stream_adders.pop(name, None)
        if usage is not None:
            del usage.streams[name]
            self._forget_if_idle(usage)

    def _forget_if_idle(self, usage: UserUsage) -> None:
        if not usage:
            del self._usage[usage.user]

    def snapshot(self) -> dict[str, dict[str, dict[str, int | None]]]:
        """Each configured user's usage and quota (``meshbus stat``, ``/metrics``): only
        the users of the config file, so as many entries as it lists."""
        shown: dict[str, dict[str, dict[str, int | None]]] = {}
        for entry in self._users():
            shown[entry.name] = {
                key: {"used": self.used(entry.name, key), "quota": getattr(entry.quotas, key)}
                for key in QUOTA_KEYS
            }
        return shown
