"""Daemon configuration: built-in defaults < TOML file < environment < command-line flags.

The socket is found in the order kvd/wire/paths.py gives for daemon, CLI and clients
alike. The TOML file (``--config``, or ``$KVD_CONFIG``, else ``/etc/kvd/kvd.toml`` when it
exists) uses the same names as the flags, with underscores::

    socket = "/run/kvd/kvd.sock"
    host_bytes = "8GiB"
    enable_prefix_reuse = true

Each setting can also come from ``KVD_<NAME>`` (``KVD_HOST_BYTES=8GiB``).

Tenants come only from the file (kvd/cache/tenants.py says how clients are mapped to them)::

    [tenants.alpha]
    uids = [1001]          # processes of these users, and/or
    gids = [2001]          # of these groups (primary or supplementary), belong to the tenant
    host_bytes = "2GiB"    # the tenant's own budget; the budgets add up to at most host_bytes
    group = "alpha"        # optional: group (name or gid) owning the tenant's extents

Without a ``[tenants]`` table the daemon has one implicit tenant that everyone reaches.

The remote tier (kvd/remote/tier.py) is off unless a master is named, in a ``[remote]`` table,
as ``KVD_REMOTE_<KEY>`` or as ``--remote-<key>`` flags::

    [remote]
    backend = "mooncake"                       # the only one: Mooncake Store
    master = "10.0.0.5:50051"                  # mooncake_master's RPC address
    metadata = "http://10.0.0.5:8080/metadata" # default: port 8080 on the master's host
    local_hostname = "10.0.0.7"                # how other hosts reach this one (default: its hostname)
    segment_bytes = "4GiB"                     # memory this host lends to the store
    policy = "publish"                         # store pages when published (write-behind), or "evict"
    reoffer_bytes_per_second = "1GiB"          # pages offered again when the store comes back, at most

The disk tier (kvd/disk/tier.py) is off unless a directory is named, in a ``[disk]`` table,
as ``KVD_DISK_<KEY>`` or as ``--disk-<key>`` flags; with tenants, each has a subdirectory
named after it and its share of ``bytes`` (as its share of ``host_bytes``)::

    [disk]
    path = "/var/lib/kvd/disk"   # an existing directory on a local file system
    bytes = "200GiB"             # the file reserved there (all tenants together)
    backlog_bytes = "256MiB"     # copies of evicted pages waiting for the disk, at most
    chunk_bytes = "64MiB"        # the file's unit of space, one page size per chunk
    stop_write_seconds = 10      # a graceful stop writes what host memory holds, this long at most
    policy = "arc"               # which pages leave a full disk: "arc" (the default) or "lru"
    min_uses = 1                 # a page RAM evicts is written once it has had this many uses
"""

from __future__ import annotations

import dataclasses
import grp
import hashlib
import os
import re
import sys
from dataclasses import dataclass

from kvd.diskstore.layout import BLOCK
from kvd.tiers.eviction import POLICIES
from kvd.wire.limits import MAX_AUX_STATE_BYTES
from kvd.wire.paths import (
    auth_socket,
    default_socket,
    tenant_socket,
)
from kvd.wire.paths import (
    config_file as find_config_file,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


# Defaults of the aux state settings, also the cache's when it runs without a config (tests).
AUX_BYTES = 256 << 20
AUX_BYTES_PER_SEQUENCE = 16 << 20


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the setting and where it came from."""


def parse_bytes(value: str | int, name: str = "size") -> int:
    """'8GiB', '512M', '1073741824' or an int → bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{name}: cannot read {value!r} as a size (examples: 4GiB, 512MiB, 1000000)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{name}: must be positive, got {value!r}")
    return n


@dataclass(frozen=True)
class TenantConfig:
    """One ``[tenants.NAME]`` table: who belongs to the tenant and what it may hold."""

    name: str
    host_bytes: int
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    group: int | None = None  # gid owning the tenant's extents; None: the daemon's group


@dataclass(frozen=True)
class RemoteConfig:
    """The ``[remote]`` table: the distributed store that shares pages between hosts."""

    master: str
    metadata: str = ""  # "": http://<master host>:8080/metadata
    backend: str = "mooncake"
    local_hostname: str = ""  # "": this host's name
    protocol: str = "tcp"
    rdma_devices: str = ""
    segment_bytes: int = 1 << 30
    backlog_bytes: int = 1 << 30  # published pages held for the store at most (per tenant)
    policy: str = "publish"  # "publish": store published pages (write-behind); "evict": only evicted ones
    reoffer_bytes_per_second: int = 1 << 30  # pages offered again when the store comes back, at most this fast

    @property
    def metadata_server(self) -> str:
        return self.metadata or f"http://{self.master.rsplit(':', 1)[0]}:8080/metadata"


_REMOTE_KEYS = {f.name: f for f in dataclasses.fields(RemoteConfig)}
REMOTE_BACKENDS = ("mooncake",)
REMOTE_POLICIES = ("publish", "evict")
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses a smaller segment


def _remote(values: dict[str, tuple[object, str]]) -> RemoteConfig | None:
    """The remote tier's settings from (value, source) by key; None when no master is named."""
    if not values:
        return None
    checked = {}
    for key, (value, source) in values.items():
        if key not in _REMOTE_KEYS:
            raise ConfigError(f"remote: unknown setting {key!r}; known: {sorted(_REMOTE_KEYS)} (from {source})")
        if key in ("segment_bytes", "backlog_bytes", "reoffer_bytes_per_second"):
            value = parse_bytes(value, f"remote.{key}")
        elif not isinstance(value, str):
            raise ConfigError(f"remote.{key}: expected a string, got {value!r} (from {source})")
        checked[key] = value
    problem = None
    if not checked.get("master"):
        problem = "master (mooncake_master's host:port) is required to turn the remote tier on"
    elif ":" not in checked["master"]:
        problem = f"master: expected host:port, got {checked['master']!r}"
    elif checked.get("backend", "mooncake") not in REMOTE_BACKENDS:
        problem = f"backend: expected one of {list(REMOTE_BACKENDS)}, got {checked['backend']!r}"
    elif checked.get("segment_bytes", MIN_SEGMENT_BYTES) < MIN_SEGMENT_BYTES:
        problem = f"segment_bytes: Mooncake needs at least 16MiB, got {checked['segment_bytes']}"
    elif checked.get("policy", "publish") not in REMOTE_POLICIES:
        problem = f"policy: expected one of {list(REMOTE_POLICIES)}, got {checked['policy']!r}"
    if problem:
        sources = sorted({source for _, source in values.values()})
        raise ConfigError(f"remote.{problem} (from {', '.join(sources)})")
    return RemoteConfig(**checked)


def _seconds(value: object, name: str, source: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not seconds >= 0:
        raise ConfigError(f"{name}: expected seconds >= 0, got {value!r} (from {source})")
    return seconds


@dataclass(frozen=True)
class DiskConfig:
    """The ``[disk]`` table: the tier below host memory, on a local file system."""

    path: str
    bytes: int
    backlog_bytes: int = 256 << 20  # copies of evicted pages waiting to be written (per tenant)
    chunk_bytes: int = 64 << 20  # kvd/diskstore/layout.py: pages of one size share a chunk
    stop_write_seconds: float = 10.0  # kvd/disk/stop_writes.py: a graceful stop's writes, at most
    policy: str = "arc"  # kvd/tiers/eviction.py: which pages leave a full disk
    # kvd/disk/admission.py: a page RAM evicts is written once it has had this many uses (its
    # publish, each allocation that hit it); 1 writes every one, 2 cuts writes 2-3x (bench/RESULTS.md)
    min_uses: int = 1

    def share(self, tenant: str | None, host_bytes: int, total_host_bytes: int) -> tuple[str, int]:
        """The directory and budget of one tenant (None: the implicit one, the whole table)."""
        if tenant is None:
            return self.path, self.bytes
        return os.path.join(self.path, tenant), self.bytes * host_bytes // total_host_bytes


_DISK_KEYS = {f.name: f for f in dataclasses.fields(DiskConfig)}
_DISK_SIZES = ("bytes", "backlog_bytes", "chunk_bytes")


def _count(value, name: str, source: str) -> int:
    """An integer setting, from TOML (an integer) or from the environment or a flag (its digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    raise ConfigError(f"{name}: expected an integer, got {value!r} (from {source})")


def _disk(values: dict[str, tuple[object, str]]) -> DiskConfig | None:
    """The disk tier's settings from (value, source) by key; None when none is given."""
    if not values:
        return None
    checked = {}
    for key, (value, source) in values.items():
        if key not in _DISK_KEYS:
            raise ConfigError(f"disk: unknown setting {key!r}; known: {sorted(_DISK_KEYS)} (from {source})")
        if key in _DISK_SIZES:
            value = parse_bytes(value, f"disk.{key}")
        elif key == "stop_write_seconds":
            value = _seconds(value, f"disk.{key}", source)
        elif key == "min_uses":
            value = _count(value, f"disk.{key}", source)
        elif not isinstance(value, str):
            raise ConfigError(f"disk.{key}: expected a string, got {value!r} (from {source})")
        checked[key] = value
    chunk = checked.get("chunk_bytes", DiskConfig.chunk_bytes)
    problem = None
    if not checked.get("path"):
        problem = "path (an existing directory) is required to turn the disk tier on"
    elif not os.path.isabs(checked["path"]):
        problem = f"path: expected an absolute path, got {checked['path']!r}"
    elif "bytes" not in checked:
        problem = 'bytes (the budget on disk, e.g. "100GiB") is required to turn the disk tier on'
    elif chunk % BLOCK or chunk < 2 * BLOCK:
        problem = f"chunk_bytes: a multiple of {BLOCK} bytes, two blocks at least, got {chunk}"
    elif checked["bytes"] < BLOCK + chunk:
        least = BLOCK + chunk
        problem = f"bytes: {checked['bytes']} holds no chunk of {chunk} bytes (chunk_bytes); give at least {least}"
    elif checked.get("policy", DiskConfig.policy) not in POLICIES:
        problem = f"policy: expected one of {list(POLICIES)}, got {checked['policy']!r}"
    elif checked.get("min_uses", 1) < 1:
        problem = f"min_uses: expected a number of uses >= 1, got {checked['min_uses']}"
    if problem:
        sources = sorted({source for _, source in values.values()})
        raise ConfigError(f"disk.{problem} (from {', '.join(sources)})")
    return DiskConfig(**checked)


@dataclass(frozen=True)
class ServeConfig:
    socket: str = dataclasses.field(default_factory=default_socket)
    host_bytes: int = 1 << 30
    extent_bytes: int = 64 << 20
    # Non-KV state (set_aux_state) lives on the daemon's heap, beside host_bytes: all
    # sequences together may hold aux_bytes (tenants: split like host_bytes), one sequence
    # aux_bytes_per_sequence, so one large blob cannot take every other sequence's room.
    aux_bytes: int = AUX_BYTES
    aux_bytes_per_sequence: int = AUX_BYTES_PER_SEQUENCE
    enable_prefix_reuse: bool = False
    metrics_port: int = 0  # 0: no Prometheus endpoint
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    lock_memory: bool = True
    socket_mode: int = 0o660
    shutdown_grace_seconds: float = 5.0
    events_endpoint: str = ""  # ZMQ PUB endpoint of the KV events (kvd/server/event_publisher.py); "": none
    events_replay_endpoint: str = ""  # its replay ROUTER endpoint; "": no replay
    events_topic: str = ""
    events_buffer_batches: int = 1000  # batches kept for replay (ZMQ and gRPC subscribers)
    tenants: tuple[TenantConfig, ...] = ()  # only from the config file
    remote: RemoteConfig | None = None  # None: no remote tier
    disk: DiskConfig | None = None  # None: no disk tier

    @property
    def shm_prefix(self) -> str:
        """Names of this daemon's extents: one prefix per socket path, so daemons never collide."""
        digest = hashlib.blake2b(os.path.abspath(self.socket).encode(), digest_size=4).hexdigest()
        return f"/kvd-{digest}"

    def aux_budget(self, host_bytes: int) -> int:
        """The aux_bytes of a tenant with ``host_bytes``: its share of the host budget."""
        return self.aux_bytes * host_bytes // self.host_bytes

    @property
    def socket_paths(self) -> tuple[str, ...]:
        """Every socket file the daemon listens on: gRPC, and with tenants the handshake's
        and one gRPC socket per tenant (kvd/cache/tenants.py)."""
        if not self.tenants:
            return (self.socket,)
        return (self.socket, auth_socket(self.socket), *(tenant_socket(self.socket, t.name) for t in self.tenants))


_FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig) if f.name not in ("tenants", "remote", "disk")}
_TABLES = {"remote": _REMOTE_KEYS, "disk": _DISK_KEYS}  # tables of settings: [remote], KVD_REMOTE_*, --remote-*
_TENANT_KEYS = ("uids", "gids", "host_bytes", "group")
_TENANT_NAME = re.compile(r"[A-Za-z0-9_]{1,32}")


def _ids(tenant: str, key: str, value, source: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ConfigError(
            f"tenants.{tenant}.{key}: expected a list of non-negative integer ids, got {value!r} (from {source})"
        )
    return tuple(value)


def _group(tenant: str, value, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value:
        try:
            return grp.getgrnam(value).gr_gid
        except KeyError:
            raise ConfigError(
                f"tenants.{tenant}.group: no group named {value!r} on this host (from {source})"
            ) from None
    raise ConfigError(f"tenants.{tenant}.group: expected a group name or gid, got {value!r} (from {source})")


def _tenant(name: str, table, source: str) -> TenantConfig:
    if not _TENANT_NAME.fullmatch(name):
        raise ConfigError(f"tenants.{name}: a tenant name is 1-32 letters, digits or underscores (from {source})")
    if not isinstance(table, dict):
        raise ConfigError(f"tenants.{name}: expected a table with {', '.join(_TENANT_KEYS)} (from {source})")
    unknown = sorted(set(table) - set(_TENANT_KEYS))
    if unknown:
        raise ConfigError(
            f"tenants.{name}: unknown setting {unknown[0]!r}; known: {list(_TENANT_KEYS)} (from {source})"
        )
    if "host_bytes" not in table:
        raise ConfigError(f'tenants.{name}: host_bytes (the tenant\'s budget, e.g. "2GiB") is required (from {source})')
    uids = _ids(name, "uids", table.get("uids", []), source)
    gids = _ids(name, "gids", table.get("gids", []), source)
    if not uids and not gids:
        raise ConfigError(f"tenants.{name}: give uids or gids, or nobody can reach the tenant (from {source})")
    try:
        host_bytes = parse_bytes(table["host_bytes"], f"tenants.{name}.host_bytes")
    except ConfigError as e:
        raise ConfigError(f"{e} (from {source})") from None
    group = _group(name, table["group"], source) if "group" in table else None
    return TenantConfig(name, host_bytes, uids, gids, group)


def _tenants(doc, source: str) -> tuple[TenantConfig, ...]:
    if not isinstance(doc, dict) or not doc:
        raise ConfigError(f"tenants: expected one [tenants.NAME] table per tenant (from {source})")
    tenants = tuple(_tenant(name, table, source) for name, table in doc.items())
    for key in ("uids", "gids"):
        owner: dict[int, str] = {}
        for t in tenants:
            for i in getattr(t, key):
                if i in owner:
                    raise ConfigError(
                        f"tenants: {key[:-1]} {i} belongs to both {owner[i]!r} and {t.name!r} (from {source})"
                    )
                owner[i] = t.name
    return tenants


def _check_events(cfg: ServeConfig) -> None:
    """A replay endpoint replays the events of an events endpoint."""
    if cfg.events_replay_endpoint and not cfg.events_endpoint:
        raise ConfigError("events_replay_endpoint: replays the events of events_endpoint, which is not set")


def _check_aux(cfg: ServeConfig) -> None:
    """The per-sequence aux limit: within the budget and within one message."""
    if cfg.aux_bytes_per_sequence > min(cfg.aux_bytes, MAX_AUX_STATE_BYTES):
        raise ConfigError(
            f"aux_bytes_per_sequence: {cfg.aux_bytes_per_sequence} bytes is over aux_bytes ({cfg.aux_bytes}) "
            f"or the {MAX_AUX_STATE_BYTES} bytes one message can carry; set it to at most "
            f"{min(cfg.aux_bytes, MAX_AUX_STATE_BYTES)}"
        )


def _check_tenants(cfg: ServeConfig) -> None:
    """Checks that need the merged settings: the budget and the auth socket's path."""
    if not cfg.tenants:
        return
    total = sum(t.host_bytes for t in cfg.tenants)
    if total > cfg.host_bytes:
        raise ConfigError(
            f"tenants: their host_bytes add up to {total} bytes, over the daemon's host_bytes of {cfg.host_bytes}; "
            "raise host_bytes or lower a tenant's budget"
        )
    for path in cfg.socket_paths:
        if len(os.fsencode(path)) > 107:
            raise ConfigError(
                f"socket: with tenants the daemon also listens on {path!r}, "
                "and a unix socket path holds at most 107 bytes"
            )


def _check_disk(cfg: ServeConfig) -> None:
    """Each tenant's share of the disk budget must hold a chunk."""
    disk = cfg.disk
    for t in cfg.tenants if disk is not None else ():
        _, budget = disk.share(t.name, t.host_bytes, cfg.host_bytes)
        if budget < BLOCK + disk.chunk_bytes:
            raise ConfigError(
                f"disk.bytes: tenant {t.name}'s share ({budget} bytes, as its host_bytes is of host_bytes) holds "
                f"no chunk of {disk.chunk_bytes} bytes; raise disk.bytes or lower disk.chunk_bytes"
            )


def _coerce(name: str, value, source: str):
    kind = _FIELDS[name].type
    try:
        if name in ("host_bytes", "extent_bytes", "aux_bytes", "aux_bytes_per_sequence"):
            return parse_bytes(value, name)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected a {kind}, got {value!r}")
        if name == "socket_mode" and isinstance(value, str):
            return int(value, 8)  # "0660", "660" or "0o660", as chmod reads it
        if kind == "int":
            return int(value, 0) if isinstance(value, str) else int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except ConfigError as e:
        raise ConfigError(f"{e} (from {source})") from None
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot use {value!r} (from {source})") from None


_ZMQ_SCHEMES = ("tcp://", "ipc://")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _check(name: str, value, source: str):
    """Range checks, so a bad value fails at start-up with its source, not deep in the daemon."""
    problem = None
    if name == "log_level" and value.upper() not in _LOG_LEVELS:
        problem = f"expected one of {', '.join(_LOG_LEVELS)}"
    elif name == "metrics_port" and not 0 <= value <= 65535:
        problem = "expected a TCP port, 1-65535 (0: no metrics endpoint)"
    elif name == "socket_mode" and not 0 <= value <= 0o777:
        problem = "expected permission bits such as 0660"
    elif name == "shutdown_grace_seconds" and not value >= 0:
        problem = "expected seconds >= 0"
    elif name in ("socket", "metrics_host") and not value:
        problem = "must not be empty"
    elif name == "socket" and len(os.fsencode(value)) > 107:
        problem = "a unix socket path holds at most 107 bytes"
    elif name in ("events_endpoint", "events_replay_endpoint") and value and not value.startswith(_ZMQ_SCHEMES):
        problem = "expected a ZMQ endpoint such as tcp://*:5557 or ipc:///run/kvd/events"
    elif name == "events_buffer_batches" and not value >= 1:
        problem = "expected a number of batches >= 1"
    if problem:
        raise ConfigError(f"{name}: {problem}, got {value!r} (from {source})")
    return value


def load(flags: dict, environ: dict | None = None, config_file: str | None = None) -> ServeConfig:
    """Merges defaults, the TOML file, KVD_* variables and flags (None means 'not given')."""
    environ = os.environ if environ is None else environ
    values: dict = {}
    tables: dict[str, dict[str, tuple[object, str]]] = {table: {} for table in _TABLES}
    path = find_config_file(environ, config_file)
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for key, value in doc.items():
            if key == "tenants":
                values[key] = _tenants(value, path)
                continue
            if key in _TABLES:
                if not isinstance(value, dict):
                    raise ConfigError(f"config file {path}: {key} must be a [{key}] table")
                tables[key].update((k, (v, path)) for k, v in value.items())
                continue
            if key not in _FIELDS:
                raise ConfigError(f"config file {path}: unknown setting {key!r}; known: {sorted(_FIELDS)}")
            values[key] = _check(key, _coerce(key, value, path), path)
    for name in _FIELDS:
        env = environ.get(f"KVD_{name.upper()}")
        if env is not None:
            source = f"KVD_{name.upper()}"
            values[name] = _check(name, _coerce(name, env, source), source)
    for table, keys in _TABLES.items():
        for key in keys:
            env = environ.get(f"KVD_{table.upper()}_{key.upper()}")
            if env is not None:
                tables[table][key] = (env, f"KVD_{table.upper()}_{key.upper()}")
    for name, value in flags.items():
        table = name.split("_", 1)[0]
        if value is not None and table in _TABLES:
            tables[table][name[len(table) + 1 :]] = (value, f"--{name.replace('_', '-')}")
        elif value is not None:
            source = f"--{name.replace('_', '-')}"
            values[name] = _check(name, _coerce(name, value, source), source)
    cfg = ServeConfig(**values, remote=_remote(tables["remote"]), disk=_disk(tables["disk"]))
    _check_events(cfg)
    _check_aux(cfg)
    _check_tenants(cfg)
    _check_disk(cfg)
    return cfg


def check_socket_directory(cfg: ServeConfig) -> None:
    """``kvd serve`` creates its socket, never the directory: a typo must not grow a tree."""
    directory = os.path.dirname(os.path.abspath(cfg.socket))
    if not os.path.isdir(directory):
        raise ConfigError(
            f"socket: directory {directory} does not exist (socket {cfg.socket!r}); "
            "create it first (systemd: RuntimeDirectory=) or choose another path"
        )
