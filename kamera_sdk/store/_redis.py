"""A Redis backend for stores shared by processes and machines (redis-py, imported lazily).

Keys, per model fingerprint ``fp`` (the braces are a Redis Cluster hash tag: one model's keys share a
slot, so the Lua scripts below touch a single slot)::

    kamera:{fp}:e:<digest>   hash: data (safetensors bytes), checksum, size, nbytes, kind, content_hash,
                             variant, created_at, uses; optional TTL, refreshed on every read
    kamera:{fp}:lru          sorted set: digest -> logical time of last use (kamera:{fp}:clock)
    kamera:{fp}:sizes        hash: digest -> serialized size (accounting survives TTL expiry)
    kamera:{fp}:bytes        serialized bytes held in this namespace
    kamera:{fp}:c:patch:<content_hash>
                             set: digests of that content's patch entries (its variants), added by every
                             put of one; dropped from it by eviction and delete, and, when expired, as the
                             set is read; it expires with ``ttl_s`` like the entries, refreshed when read

Puts, reads and deletes are Lua scripts, so accounting and LRU eviction stay consistent with many writers.
``max_bytes`` is a budget per fingerprint namespace. Reads verify the checksum and fingerprint like the
disk backend; a refused entry is deleted. Every redis error becomes StoreError at this boundary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

from kamera_engine.errors import ChecksumError, InvalidInputError, StoreError, positive_int

from ._auth import EntryAuth
from ._entry import EntryKey, EntryKind, StoreEntry, decode, header_summary, read_header
from ._registry import register_backend

log = logging.getLogger("kamera.store")

#: Largest entry accepted by default (Redis refuses values over 512 MB).
DEFAULT_MAX_ENTRY_BYTES = 256 << 20
URL_SCHEMES = ("redis://", "rediss://", "unix://")

# Patch entries are listed in their content's set (see ``variants``); this drops an entry from it before
# the entry goes (entry key, digest, namespace prefix). Redis deletes a set when its last member goes.
_UNLIST = """
local function unlist(entry, digest, ns)
  local f = redis.call('HMGET', entry, 'kind', 'content_hash')
  if f[1] == 'patch' and f[2] then redis.call('SREM', ns .. 'c:patch:' .. f[2], digest) end
end
"""

# KEYS: entry, lru, sizes, bytes, clock, content set
# ARGV: digest, data, checksum, nbytes, size, created_at, ttl_ms, max_bytes, entry_prefix, kind, content_hash,
#       variant, tensors
_PUT = (
    _UNLIST
    + """
local digest = ARGV[1]
local ttl = tonumber(ARGV[7])
if ARGV[10] == 'patch' then  -- listed even when already stored: a set that lost it gets it back
  redis.call('SADD', KEYS[6], digest)
  if ttl > 0 then redis.call('PEXPIRE', KEYS[6], ttl) end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, 0} end
local old = redis.call('HGET', KEYS[3], digest)
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('HSET', KEYS[1], 'data', ARGV[2], 'checksum', ARGV[3], 'nbytes', ARGV[4], 'size', ARGV[5],
           'created_at', ARGV[6], 'uses', 0, 'kind', ARGV[10], 'content_hash', ARGV[11], 'variant', ARGV[12],
           'tensors', ARGV[13])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
local t = redis.call('INCR', KEYS[5])
redis.call('ZADD', KEYS[2], t, digest)
redis.call('HSET', KEYS[3], digest, ARGV[5])
local total = redis.call('INCRBY', KEYS[4], ARGV[5])
local budget = tonumber(ARGV[8])
local evicted = 0
if budget > 0 then
  while total > budget do
    local v = redis.call('ZPOPMIN', KEYS[2])
    if #v == 0 then break end
    local d = v[1]
    if d == digest then
      redis.call('ZADD', KEYS[2], t, d)
      break
    end
    local s = redis.call('HGET', KEYS[3], d)
    redis.call('HDEL', KEYS[3], d)
    if s then total = redis.call('DECRBY', KEYS[4], s) end
    unlist(ARGV[9] .. d, d, string.sub(ARGV[9], 1, -3))
    redis.call('DEL', ARGV[9] .. d)
    evicted = evicted + 1
  end
end
return {1, evicted}
"""
)

# KEYS: entry, lru, sizes, bytes, clock, content set; ARGV: digest, ttl_ms
_GET = """
local v = redis.call('HMGET', KEYS[1], 'data', 'checksum', 'created_at', 'uses')
if not v[1] then
  local s = redis.call('HGET', KEYS[3], ARGV[1])
  if s then
    redis.call('HDEL', KEYS[3], ARGV[1])
    redis.call('DECRBY', KEYS[4], s)
  end
  redis.call('ZREM', KEYS[2], ARGV[1])
  return false
end
local t = redis.call('INCR', KEYS[5])
redis.call('ZADD', KEYS[2], t, ARGV[1])
redis.call('HINCRBY', KEYS[1], 'uses', 1)
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[6], ttl)  -- a patch's content set lives as long as its entries (0 if none)
end
return v
"""

# KEYS: entry, lru, sizes, bytes; ARGV: digest, checksum ('' = any)
_DELETE = (
    _UNLIST
    + """
if ARGV[2] ~= '' then
  local c = redis.call('HGET', KEYS[1], 'checksum')
  if c and c ~= ARGV[2] then return 0 end
end
unlist(KEYS[1], ARGV[1], string.sub(KEYS[2], 1, -4))
local existed = redis.call('DEL', KEYS[1])
local s = redis.call('HGET', KEYS[3], ARGV[1])
if s then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('DECRBY', KEYS[4], s)
end
redis.call('ZREM', KEYS[2], ARGV[1])
return existed
"""
)

# KEYS: content set; ARGV: entry prefix, ttl_ms. The members whose entry still exists (the others, expired
# or evicted, are dropped in the same step, so a concurrent put of one of them is never undone).
_LIST = """
local out = {}
for _, d in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. d) == 1 then out[#out + 1] = d else redis.call('SREM', KEYS[1], d) end
end
local ttl = tonumber(ARGV[2])
if ttl > 0 and #out > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return out
"""

# KEYS: entry, content set; ARGV: digest, ttl_ms. Lists a stored entry in its set in one step (an entry
# evicted meanwhile is written again by the caller, not listed while absent).
_RELIST = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[1])
local ttl = tonumber(ARGV[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return 1
"""


def _namespace(fingerprint: str) -> str:
    return f"kamera:{{{fingerprint}}}:"


def _content_set(key: EntryKey) -> str:
    return f"{_namespace(key.fingerprint)}c:{key.kind.value}:{key.content_hash}"


class RedisBackend:
    """Entries in Redis at ``url`` (``redis://host:port/db``, ``rediss://`` or ``unix://``).

    ``ttl_s``: entries expire after this many seconds without a read (None: never). ``max_bytes``: serialized
    bytes kept per model fingerprint; least recently used entries are evicted past it. ``auth``: entries
    carry that secret's MAC and are read only with a valid one (a forged entry is refused and deleted).
    """

    name: ClassVar[str] = "redis"

    def __init__(
        self,
        url: str,
        ttl_s: float | None = None,
        max_bytes: int | None = None,
        *,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        socket_timeout_s: float = 30.0,
        auth: EntryAuth | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(URL_SCHEMES):
            raise InvalidInputError(f"redis url must start with one of {URL_SCHEMES}, got {url!r}")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or ttl_s <= 0):
            raise InvalidInputError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")
        for label, value in (("max_bytes", max_bytes), ("max_entry_bytes", max_entry_bytes)):
            positive_int(label, value, optional=True)
        try:
            import redis
        except ImportError as exc:
            raise StoreError("the Redis store needs redis-py: pip install 'kamera[redis]'") from exc
        self._redis_error: type[BaseException] = redis.exceptions.RedisError
        self.url = url
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.auth = auth  # with a secret: entries are written tagged, and read only with a valid tag
        self.evictions = 0
        self.index_rebuilds = 0  # every key is its own record: there is no separate index to lose
        self._ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        try:
            self.client: Any = redis.Redis.from_url(
                url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
            )
            self.client.ping()
            self._put_script: Callable[..., Any] = self.client.register_script(_PUT)
            self._get_script: Callable[..., Any] = self.client.register_script(_GET)
            self._delete_script: Callable[..., Any] = self.client.register_script(_DELETE)
            self._list_script: Callable[..., Any] = self.client.register_script(_LIST)
            self._relist_script: Callable[..., Any] = self.client.register_script(_RELIST)
        except (self._redis_error, ValueError) as exc:
            raise StoreError(f"cannot connect to redis at {self._safe_url()}: {exc}") from exc

    def __repr__(self) -> str:
        return f"RedisBackend({self._safe_url()!r})"

    def _safe_url(self) -> str:
        """The URL without a password."""
        head, sep, tail = self.url.partition("@")
        return f"{head.split('://')[0]}://***@{tail}" if sep else self.url

    def _keys(self, key: EntryKey) -> list[str]:
        ns = _namespace(key.fingerprint)
        return [f"{ns}e:{key.digest}", f"{ns}lru", f"{ns}sizes", f"{ns}bytes", f"{ns}clock", _content_set(key)]

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._redis_error as exc:  # type: ignore[misc]
            raise StoreError(f"redis {what} failed at {self._safe_url()}: {exc}") from exc

    # -- reads ---------------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> StoreEntry | None:
        """The verified entry, or None on a miss. A refused entry is deleted, then the error raised."""
        res = self._call("get", self._get_script, keys=self._keys(key), args=[key.digest, self._ttl_ms])
        if res is None:
            return None
        blob, checksum, created_at, uses = res
        if len(blob) > self.max_entry_bytes:  # too large for this reader; the entry may be fine: keep it
            raise StoreError(f"entry {key.digest[:12]} is {len(blob)} bytes, over max_entry_bytes")
        try:
            if checksum is None:
                raise ChecksumError(f"entry {key.digest[:12]} has no checksum")
            entry = decode(blob, key, checksum.decode(), self.auth)
        except StoreError:
            # delete only the entry that was read (a concurrent rewrite carries another checksum)
            held = "" if checksum is None else checksum.decode()
            self._call("delete", self._delete_script, keys=self._keys(key)[:4], args=[key.digest, held])
            log.warning("store: deleted refused redis entry %s", key.digest[:12])
            raise
        entry.created_at = float(created_at or time.time())
        entry.last_used = time.time()
        entry.uses = int(uses or 0) + 1
        return entry

    def contains(self, key: EntryKey) -> bool:
        return bool(self._call("exists", self.client.exists, self._keys(key)[0]))

    def keys(self, fingerprint: str | None = None) -> list[EntryKey]:
        """Every stored key (of one model when ``fingerprint`` is given); scans the keyspace."""
        pattern = f"{_namespace(fingerprint)}e:*" if fingerprint else "kamera:{*}:e:*"
        out: list[EntryKey] = []
        for name in self._call("scan", lambda: list(self.client.scan_iter(match=pattern, count=500))):
            fp = name.decode().split("{", 1)[1].split("}", 1)[0]
            kind, content, variant = self._call("hmget", self.client.hmget, name, "kind", "content_hash", "variant")
            if kind is None or content is None:
                continue  # expired between scan and read
            out.append(EntryKey(fp, kind.decode(), content.decode(), (variant or b"").decode()))
        return out

    def variants(self, fingerprint: str, kind: EntryKind, content_hash: str) -> list[EntryKey]:
        """Every stored patch entry of one model and content: the members of its content set whose entry
        still exists (the put script lists each patch entry there; the others are dropped as they are
        read). Only patch entries are listed: ``InvalidInputError`` for another kind."""
        if EntryKind(kind) is not EntryKind.PATCH:
            raise InvalidInputError(f"the redis backend lists variants of patch entries only, not {kind!r}")
        key = EntryKey(fingerprint, EntryKind.PATCH, content_hash)
        ns = _namespace(fingerprint)
        members = self._call("list", self._list_script, keys=[_content_set(key)], args=[f"{ns}e:", self._ttl_ms])
        digests = sorted(m.decode() for m in members)

        def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for d in digests:
                pipe.hget(f"{ns}e:{d}", "variant")
            return list(pipe.execute())

        variants = self._call("hget", read) if digests else []
        return [EntryKey(fingerprint, EntryKind.PATCH, content_hash, v.decode()) for v in variants if v is not None]

    def total_bytes(self, fingerprint: str | None = None) -> int:
        """Serialized bytes held (one namespace, or all Kamera namespaces in this database)."""
        if fingerprint is not None:
            return int(self._call("get", self.client.get, f"{_namespace(fingerprint)}bytes") or 0)
        names = self._call("scan", lambda: list(self.client.scan_iter(match="kamera:{*}:bytes", count=500)))
        values = self._call("mget", self.client.mget, names) if names else []
        return sum(int(v or 0) for v in values)

    # -- writes --------------------------------------------------------------------------------------
    def put(self, entry: StoreEntry) -> int:
        """Store ``entry``; 0 if it is already there, else the bytes written."""
        if not isinstance(entry, StoreEntry):
            raise InvalidInputError(f"expected a StoreEntry, got {type(entry).__name__}")
        if entry.nbytes > self.max_entry_bytes:
            raise StoreError(f"entry of {entry.nbytes} bytes exceeds max_entry_bytes={self.max_entry_bytes}")
        if entry.key.kind is EntryKind.PATCH:
            if self._call("relist", self._relist, entry.key):  # stored already: now listed in its set
                return 0
        elif self.contains(entry.key):
            return 0
        blob = entry.encode(self.auth)
        return self._write(entry.key, blob, entry.checksum, entry.summary(), entry.nbytes, entry.created_at)

    def _relist(self, key: EntryKey) -> bool:
        """List a stored patch entry in its content set; False (nothing done) when it is not stored."""
        keys = [self._keys(key)[0], _content_set(key)]
        return bool(self._relist_script(keys=keys, args=[key.digest, self._ttl_ms]))

    def put_blob(self, key: EntryKey, blob: bytes) -> int:
        """Store serialized bytes under ``key`` unchanged (reads verify them). 0 if already stored."""
        if not isinstance(blob, (bytes, bytearray)):
            raise InvalidInputError("blob must be bytes")
        header, _ = read_header(blob)
        summary, nbytes = header_summary(header)
        return self._write(key, bytes(blob), hashlib.sha256(blob).hexdigest(), summary, nbytes, time.time())

    def _write(
        self, key: EntryKey, blob: bytes, checksum: str, summary: dict[str, Any], nbytes: int, created_at: float
    ) -> int:
        size = len(blob)
        if size > self.max_entry_bytes:
            raise StoreError(f"entry of {size} bytes exceeds max_entry_bytes={self.max_entry_bytes}")
        if self.max_bytes is not None and size > self.max_bytes:
            raise StoreError(f"entry of {size} bytes exceeds the redis budget max_bytes={self.max_bytes}")
        keys = self._keys(key)
        args = [
            key.digest,
            blob,
            checksum,
            nbytes,
            size,
            repr(created_at),
            self._ttl_ms,
            self.max_bytes or 0,
            keys[0][: -len(key.digest)],
            key.kind.value,
            key.content_hash,
            key.variant,
            json.dumps(summary, sort_keys=True),
        ]
        written, evicted = self._call("put", self._put_script, keys=keys, args=args)
        self.evictions += int(evicted)
        return size if written else 0

    def delete(self, key: EntryKey) -> bool:
        return bool(self._call("delete", self._delete_script, keys=self._keys(key)[:4], args=[key.digest, ""]))

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis_error as exc:  # type: ignore[misc]
            log.debug("store: closing redis client: %s", exc)


@register_backend(*(scheme.removesuffix("://") for scheme in URL_SCHEMES))
def _open_redis(spec: str, *, max_bytes: int | None, ttl_s: float | None) -> RedisBackend:
    """``redis://``, ``rediss://`` (TLS) or ``unix://`` URL: a RedisBackend (``max_bytes`` per model)."""
    return RedisBackend(spec, ttl_s=ttl_s, max_bytes=max_bytes)
