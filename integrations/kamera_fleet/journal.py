"""The session journal: each fleet session's window, kept in Redis as it changes, so any replica can rebuild it.

What is journaled is what the server applies through the window's public API, read back off the window
after each request: the options the session was opened with, every chunk it knows (kind, text or token
ids: the content the store does not hold), the active chunks in order, the evicted set, the parent of a
fork, the operations in arrival order, and the last mutating request's id and response (so a request
retried after its replica died is answered, not applied twice). Canonicals and patches are not here: they
are in the shared store, by content hash. Keys, under ``prefix`` (default ``kamera:fleet:``)::

    <prefix>s:<session>        hash: version, options (JSON), order (JSON), evicted (JSON), parent,
                               request (last mutating request id), response (its JSON body), owner
                               (the replica holding the window: what the router reads)
    <prefix>s:<session>:c      hash: chunk id -> JSON {kind, text, token_ids}
    <prefix>s:<session>:ops    list: JSON {op, version, chunks} in order
    <prefix>rebuilds           list: JSON {session, seconds, tokens, replica} of every rebuild

Writes are compare-and-set on ``version`` (a Lua script), so two replicas that both hold a session (a
request routed away during a scale event) cannot interleave their states: the loser re-reads. Every key
expires ``ttl_s`` after its last write, like the server's idle sessions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kamera_sdk import InvalidInputError, StoreError

# KEYS: head, chunks, ops; ARGV: expected version, new version, order, evicted, options, parent, request,
# response, ttl_ms, op, then chunk id / JSON pairs. Returns 1, or 0 when the version moved meanwhile.
_WRITE = """
local v = redis.call('HGET', KEYS[1], 'version')
if (v or '0') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'order', ARGV[3], 'evicted', ARGV[4], 'options', ARGV[5],
           'parent', ARGV[6], 'request', ARGV[7], 'response', ARGV[8])
for i = 11, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('RPUSH', KEYS[3], ARGV[10])
local ttl = tonumber(ARGV[9])
if ttl > 0 then
  for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl) end
end
return 1
"""


@dataclass
class WindowRecord:
    """One session's journaled window: enough to build the same window on any replica."""

    session: str
    version: int
    options: dict[str, Any]
    order: list[str]
    evicted: list[str]
    chunks: dict[str, dict[str, Any]] = field(default_factory=dict)
    parent: str = ""
    request: str = ""
    response: str = ""

    def tokens(self) -> int:
        """Tokens of the active chunks (what a full re-prefill of the window runs)."""
        return sum(len(self.chunks[c]["token_ids"]) for c in self.order)


class JournalLostError(StoreError):
    """A session is not on this replica and its journal is gone (never created, deleted, expired, or lost)."""


class SessionJournal:
    """Fleet sessions' windows in Redis at ``url`` (redis-py, like the store's backend)."""

    def __init__(self, url: str, *, prefix: str = "kamera:fleet:", ttl_s: float | None = 3600.0) -> None:
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - the fleet extra installs it
            raise StoreError("the fleet journal needs redis-py: pip install 'kamera[fleet]'") from exc
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidInputError(f"the fleet journal needs a redis:// URL, got {url!r}")
        self.url = url
        self.prefix = prefix
        self._ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        self._error: type[BaseException] = redis.exceptions.RedisError
        self.client: Any = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=30)
        self._write = self.client.register_script(_WRITE)

    def _head(self, session: str) -> str:
        return f"{self.prefix}s:{session}"

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._error as exc:  # type: ignore[misc]
            raise StoreError(f"fleet journal {what} failed: {exc}") from exc

    def version(self, session: str) -> int | None:
        """The journaled version of ``session``, None when it has no journal."""
        v = self._call("read", self.client.hget, self._head(session), "version")
        return None if v is None else int(v)

    def read(self, session: str) -> WindowRecord | None:
        """The whole record, or None when the session has no journal."""
        head = self._head(session)
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(head)
        pipe.hgetall(head + ":c")
        raw, chunks = self._call("read", pipe.execute)
        if not raw:
            return None
        h = {k.decode(): v.decode() for k, v in raw.items()}
        return WindowRecord(
            session=session,
            version=int(h["version"]),
            options=json.loads(h["options"]),
            order=json.loads(h["order"]),
            evicted=json.loads(h["evicted"]),
            chunks={k.decode(): json.loads(v) for k, v in chunks.items()},
            parent=h.get("parent", ""),
            request=h.get("request", ""),
            response=h.get("response", ""),
        )

    def write(
        self,
        record: WindowRecord,
        *,
        expected: int,
        op: str,
        new_chunks: dict[str, dict[str, Any]],
    ) -> bool:
        """Journal ``record`` (its version must be ``expected + 1``) with the chunks it adds; False when
        another replica moved the session's version meanwhile (nothing is written then)."""
        head = self._head(record.session)
        pairs = [x for cid, spec in new_chunks.items() for x in (cid, json.dumps(spec))]
        entry = json.dumps({"op": op, "version": record.version, "chunks": record.order})
        args = [expected, record.version, json.dumps(record.order), json.dumps(record.evicted),
                json.dumps(record.options), record.parent, record.request, record.response, self._ttl_ms,
                entry, *pairs]  # fmt: skip
        keys = [head, head + ":c", head + ":ops"]
        return bool(self._call("write", self._write, keys=keys, args=args))

    def ops(self, session: str) -> list[dict[str, Any]]:
        """The operations that shaped the session, oldest first."""
        return [json.loads(x) for x in self._call("read", self.client.lrange, self._head(session) + ":ops", 0, -1)]

    def set_owner(self, session: str, replica: str) -> None:
        """Record the replica holding ``session`` (the router reads it to route the session's requests)."""
        self._call("write", self.client.hset, self._head(session), "owner", replica)

    def delete(self, session: str) -> None:
        head = self._head(session)
        self._call("delete", self.client.delete, head, head + ":c", head + ":ops")

    def record_rebuild(self, info: dict[str, Any]) -> None:
        self._call("write", self.client.rpush, f"{self.prefix}rebuilds", json.dumps(info))

    def rebuilds(self) -> list[dict[str, Any]]:
        """Every rebuild any replica did, oldest first."""
        return [json.loads(x) for x in self._call("read", self.client.lrange, f"{self.prefix}rebuilds", 0, -1)]

    def close(self) -> None:
        self.client.close()
