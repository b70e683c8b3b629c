"""Daemon configuration: built-in defaults < TOML file < environment < command-line flags.

The TOML file (``--config``, or ``$KVD_CONFIG``, else ``/etc/kvd/kvd.toml`` when it
exists) uses the same names as the flags, with underscores::

    socket = "/run/kvd/kvd.sock"
    host_bytes = "8GiB"
    enable_prefix_reuse = true

Each setting can also come from ``KVD_<NAME>`` (``KVD_HOST_BYTES=8GiB``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import sys
from dataclasses import dataclass

from kvd.wire.paths import default_socket

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_FILE = "/etc/kvd/kvd.toml"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


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
class ServeConfig:
    socket: str = dataclasses.field(default_factory=default_socket)
    host_bytes: int = 1 << 30
    extent_bytes: int = 64 << 20
    enable_prefix_reuse: bool = False
    metrics_port: int = 0          # 0: no Prometheus endpoint
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    lock_memory: bool = True
    socket_mode: int = 0o660
    shutdown_grace_seconds: float = 5.0

    @property
    def shm_prefix(self) -> str:
        """Names of this daemon's extents: one prefix per socket path, so daemons never collide."""
        digest = hashlib.blake2b(os.path.abspath(self.socket).encode(), digest_size=4).hexdigest()
        return f"/kvd-{digest}"


_FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}


def _coerce(name: str, value, source: str):
    kind = _FIELDS[name].type
    try:
        if name in ("host_bytes", "extent_bytes"):
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
    if problem:
        raise ConfigError(f"{name}: {problem}, got {value!r} (from {source})")
    return value


def load(flags: dict, environ: dict | None = None, config_file: str | None = None) -> ServeConfig:
    """Merges defaults, the TOML file, KVD_* variables and flags (None means 'not given')."""
    environ = os.environ if environ is None else environ
    values: dict = {}
    path = config_file or environ.get("KVD_CONFIG")
    if path is None and os.path.exists(DEFAULT_CONFIG_FILE):
        path = DEFAULT_CONFIG_FILE
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for key, value in doc.items():
            if key not in _FIELDS:
                raise ConfigError(f"config file {path}: unknown setting {key!r}; known: {sorted(_FIELDS)}")
            values[key] = _check(key, _coerce(key, value, path), path)
    for name in _FIELDS:
        env = environ.get(f"KVD_{name.upper()}")
        if env is not None:
            source = f"KVD_{name.upper()}"
            values[name] = _check(name, _coerce(name, env, source), source)
    for name, value in flags.items():
        if value is not None:
            source = f"--{name.replace('_', '-')}"
            values[name] = _check(name, _coerce(name, value, source), source)
    return ServeConfig(**values)
