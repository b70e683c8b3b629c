"""``kvd``: serve, stats, verify, reset, clean, health, doctor (the README's synopsis lists
every option).

Exit status, one meaning each: 0 done; 1 a runtime failure (no daemon answers, the
daemon cannot start, ``verify`` found corrupted pages, ``clean`` found a daemon
running, ``health`` is not SERVING, ``doctor`` found a FAIL); 2 bad usage or configuration
(argparse errors, a setting that cannot be used).
"""

from __future__ import annotations

import argparse
import json
import os
import socket as socket_mod
import stat
import subprocess
import sys
import time

from kvd import config as config_mod
from kvd.wire.paths import DEFAULT_CONFIG_FILE


def _serve(args) -> int:
    flags = {
        "socket": args.socket,
        "host_bytes": args.host_bytes,
        "extent_bytes": args.extent_bytes,
        "aux_bytes": args.aux_bytes,
        "aux_bytes_per_sequence": args.aux_bytes_per_sequence,
        "enable_prefix_reuse": args.enable_prefix_reuse,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "log_level": args.log_level,
        "events_endpoint": args.events_endpoint,
        "events_replay_endpoint": args.events_replay_endpoint,
        **{f"remote_{key}": getattr(args, f"remote_{key}") for key in _REMOTE_FLAGS},
        **{f"disk_{key}": getattr(args, f"disk_{key}") for key in _DISK_FLAGS},
    }
    cfg = config_mod.load(flags, config_file=args.config)
    config_mod.check_socket_directory(cfg)
    from kvd.server.daemon import StartupError, serve  # the daemon's modules load only for `serve`

    metrics = None
    if cfg.metrics_port:
        from kvd.server.metrics import MetricsExporter

        metrics = MetricsExporter(isolated=bool(cfg.tenants))
    try:
        serve(cfg, metrics)
    except StartupError as e:
        print(f"kvd serve: {e}", file=sys.stderr)
        return 1
    return 0


_DISK_FLAGS = {
    "path": "a directory for the disk tier's file: turns the disk tier on (default: off)",
    "bytes": "the disk tier's budget, e.g. 100GiB (tenants share it as they share --host-bytes)",
    "backlog_bytes": "copies of evicted pages waiting for the disk, at most (default 256MiB)",
    "chunk_bytes": "the disk file's unit of space (default 64MiB)",
    "stop_write_seconds": "a graceful stop writes what host memory holds to disk, this long at most (default 10)",
    "policy": "which pages leave a full disk: arc (the default) or lru",
    "min_uses": "write a page RAM evicts once it has had this many uses (default 1: every one)",
}

_REMOTE_FLAGS = {
    "master": "mooncake_master's RPC address host:port: turns the remote tier on (default: off)",
    "metadata": "the store's metadata server (default http://MASTER_HOST:8080/metadata)",
    "local_hostname": "the address other hosts reach this one at (default: the hostname)",
    "segment_bytes": "memory this host lends to the store, e.g. 4GiB (default 1GiB)",
    "backend": "the remote store (mooncake, the default and only one)",
    "policy": "when pages go to the store: publish (write-behind, the default) or evict (only evicted pages)",
    "reoffer_bytes_per_second": "how fast pages are offered again when the store comes back (default 1GiB)",
}


def _socket(args) -> str:
    return config_mod.load({"socket": args.socket}, config_file=args.config).socket


def stats_table(stats: dict) -> str:
    """A readable table of the JSON stats: totals and one column per namespace."""
    from kvd.cache.stats import STAT_FIELDS

    columns = [("total", stats)] + [(f"ns {n['namespace_id']} {n['model']}", n) for n in stats["namespaces"]]
    width = max(len(f) for f in STAT_FIELDS)
    head = " " * width + "".join(f"  {name[:24]:>24}" for name, _ in columns)
    rows = [f"{f:<{width}}" + "".join(f"  {col[f]:>24,}" for _, col in columns) for f in STAT_FIELDS]
    footer = (
        f"host budget {stats['host_bytes']:,} bytes: {stats['host_bytes_used']:,} used, "
        f"{stats['host_bytes_free']:,} free; arena {stats['arena_bytes']:,} bytes, "
        f"prefix reuse {'on' if stats['prefix_reuse'] else 'off'}, "
        f"extents refused by /dev/shm {stats['shm_refusals']:,}"
    )
    lines = [head, *rows, footer, recovery_line(stats["recovery"])]
    r = stats["remote"]
    if r["state"] != "off":
        lines.append(
            f"remote store {r['state']}: {r['stored_pages']:,} pages stored "
            f"({r['reoffered_pages']:,} offered again), {r['fetched_pages']:,} fetched "
            f"({r['hit_tokens']:,} hit tokens), {r['refused_pages']:,} refused, {r['skipped_pages']:,} skipped, "
            f"{r['rejected_pages']:,} rejected, {r['errors']:,} errors, "
            f"{r['outages']:,} outages ({r['resets']:,} resets)"
        )
    d = stats["disk"]
    if d["state"] != "off":
        lines.append(
            f"disk tier: {d['pages']:,} pages ({d['bytes']:,} of {d['capacity_bytes']:,} bytes, "
            f"{'direct' if d['direct_io'] else 'buffered'} I/O, {d['recovered_pages']:,} found at start), "
            f"{d['written_pages']:,} written, {d['fetched_pages']:,} promoted ({d['hit_tokens']:,} hit tokens), "
            f"{d['evicted_pages']:,} evicted, {d['skipped_pages']:,} skipped, {d['refused_pages']:,} refused, "
            f"{d['rejected_pages']:,} rejected, {d['errors']:,} errors"
        )
        lines.append(disk_io_line(d))
    return "\n".join(lines)


def disk_io_line(d: dict) -> str:
    """One line on the disk tier's transfers: bytes each way, the write backlog, the promotion latency."""
    from kvd.tiers.stats import bucket_quantile

    reads = sum(d["promotion_buckets"])
    latency = "no promotion yet"
    if reads:
        p50, p99 = (bucket_quantile(d["promotion_buckets"], q) for q in (0.5, 0.99))
        mean = d["promotion_seconds"] / reads
        latency = f"promotion reads p50 <= {p50:g} s, p99 <= {p99:g} s, mean {mean:.3f} s ({reads:,} batches)"
    return (
        f"disk tier I/O: {d['written_bytes']:,} bytes written, {d['read_bytes']:,} read, "
        f"{d['backlog_bytes']:,} waiting to be written; {latency}"
    )


def recovery_line(r: dict) -> str:
    """One line on what the daemon's start found in shared memory, dropped pages by reason."""
    dropped = ", ".join(f"{reason} {n:,}" for reason, n in r["dropped_pages"].items())
    line = (
        f"last start: recovered {r['recovered_pages']:,} published pages ({r['resealed_pages']:,} sealed by "
        f"recovery); dropped {dropped}; incomplete extents {r['incomplete_extents']:,}"
    )
    line += f"; {r['pending_pages']:,} still to verify (recovering while serving)" if r["pending_pages"] else ""
    return line + (f"; discarded every segment: {r['discarded']}" if r["discarded"] else "")


def _stats(args) -> int:
    from kvd.wire.admin import fetch_stats
    from kvd.wire.errors import KVDError

    if args.watch is not None and not args.watch > 0:
        print(f"kvd stats: --watch needs a positive number of seconds, got {args.watch}", file=sys.stderr)
        return 2
    path = _socket(args)
    while True:
        try:
            stats = fetch_stats(path)
        except KVDError as e:
            print(f"kvd stats: no answer from the daemon on {path} ({e})", file=sys.stderr)
            return 1
        if args.json:  # watching: one object per line, for `jq` and line-oriented tools
            print(json.dumps(stats) if args.watch else json.dumps(stats, indent=2))
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
            print(stats_table(stats))
        if not args.watch:
            return 0
        sys.stdout.flush()
        time.sleep(args.watch)


def _verify(args) -> int:
    from kvd.wire.admin import verify_pages
    from kvd.wire.errors import KVDError

    path = _socket(args)
    try:
        result = verify_pages(path)
    except KVDError as e:
        print(f"kvd verify: no answer from the daemon on {path} ({e})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"verified {result['checked_pages']} published pages ({result['checked_bytes']:,} bytes) in "
            f"{result['seconds'] * 1e3:.1f} ms: {result['corrupted_pages']} corrupted pages dropped"
        )
        print(recovery_line(result["recovery"]))
    return 1 if result["corrupted_pages"] else 0


def _reset(args) -> int:
    from kvd.wire.admin import reset_prefix_cache
    from kvd.wire.errors import KVDError

    path = _socket(args)
    try:
        result = reset_prefix_cache(path, args.namespace)
    except KVDError as e:
        print(f"kvd reset: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"dropped {result['dropped_pages']} cached pages; kept {result['kept_pages']} published pages in use")
    return 0


def _clean(args) -> int:
    from kvd.cache import token_buffers
    from kvd.core.arena import daemon_segments, leftover_segments, unlink_segments

    cfg = config_mod.load({"socket": args.socket}, config_file=args.config)
    try:
        with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as sock:
            sock.connect(cfg.socket)
        print(f"kvd clean: a daemon is running on {cfg.socket}; stop it first", file=sys.stderr)
        return 1
    except (FileNotFoundError, ConnectionRefusedError):
        pass  # no daemon: the socket is missing, or a dead daemon's file
    except OSError as e:  # e.g. EACCES: a daemon may be running; never pull its memory away
        print(f"kvd clean: cannot tell whether a daemon runs on {cfg.socket} ({e.strerror})", file=sys.stderr)
        return 1
    from kvd.cache.tenants import tenant_prefix

    prefixes = [cfg.shm_prefix, *(tenant_prefix(cfg.shm_prefix, t.name) for t in cfg.tenants)]
    names = [n for prefix in prefixes for n in leftover_segments(prefix)]
    try:
        for prefix in prefixes:
            unlink_segments(daemon_segments(prefix))  # extents, their metadata, the manifest
            unlink_segments(token_buffers.leftovers(prefix))
    except PermissionError:
        print(
            f"kvd clean: not allowed to remove the extents of {cfg.socket}; run it as the daemon's user",
            file=sys.stderr,
        )
        return 1
    from kvd.wire.paths import auth_socket

    for path in dict.fromkeys((*cfg.socket_paths, auth_socket(cfg.socket))):
        if os.path.exists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)  # a dead daemon's socket files
    print(f"removed {len(names)} shared-memory extents of {cfg.socket}")
    return 0


def _health(args) -> int:
    from kvd.wire.errors import KVDError
    from kvd.wire.health import health_status

    path = _socket(args)
    try:
        status = health_status(path, args.timeout)
    except KVDError as e:
        print(f"kvd health: no answer from the daemon on {path} ({e})", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _doctor(args) -> int:
    """The engine's checks are a client's (engine_client/doctor.py): they run in a process of
    their own, as `kvd serve` runs apart from its clients, since the daemon's package never
    imports the client (DESIGN.md). Its options are the doctor's own (``kvd doctor --help``).
    ``kvd doctor --disk`` checks the disk tier here instead (kvd/disk/doctor.py)."""
    if "--disk" in args.passed_on:
        return _disk_doctor(_disk_doctor_parser().parse_args(args.passed_on))
    return subprocess.run([sys.executable, "-m", "engine_client.doctor", *args.passed_on]).returncode


def _disk_doctor_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvd doctor",
        description="check, where the daemon runs and as its user, the disk tier its config sets up",
    )
    p.add_argument("--disk", action="store_true", required=True, help="check the disk tier (this mode)")
    p.add_argument("--config", help=f"the daemon's TOML config file (default: $KVD_CONFIG, else {DEFAULT_CONFIG_FILE})")
    p.add_argument("--disk-path", help="the directory to check, in place of the config's disk.path")
    p.add_argument("--disk-bytes", help="the budget to check, in place of the config's disk.bytes")
    p.add_argument("--disk-chunk-bytes", help="the file's unit of space, in place of the config's disk.chunk_bytes")
    p.add_argument("--probe-bytes", default="64MiB", help="bytes the read probe writes and reads back (default 64MiB)")
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    return p


def _disk_doctor(args) -> int:
    from kvd.disk.doctor import examine
    from kvd.wire.checks import passed, report_json, report_text

    flags = {"disk_path": args.disk_path, "disk_bytes": args.disk_bytes, "disk_chunk_bytes": args.disk_chunk_bytes}
    cfg = config_mod.load(flags, config_file=args.config)
    checks = examine(cfg, config_mod.parse_bytes(args.probe_bytes, "--probe-bytes"))
    print(report_json(checks) if args.json else report_text(checks, "the disk tier here"))
    return 0 if passed(checks) else 1


def _common_options(sp: argparse.ArgumentParser) -> None:
    sp.set_defaults(parser=sp)  # main() reports unknown options with this subcommand's usage
    sp.add_argument(
        "--socket",
        help="unix socket path (default: $KVD_SOCKET, else the config file's socket, "
        "else /run/kvd/kvd.sock if it exists, else $XDG_RUNTIME_DIR/kvd.sock "
        "or /tmp/kvd-UID.sock)",
    )
    sp.add_argument(
        "--config",
        help=f"TOML config file (default: $KVD_CONFIG, else {DEFAULT_CONFIG_FILE} if present)",
    )


def _serve_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host-bytes", help="budget for all host pages, e.g. 8GiB (default 1GiB)")
    s.add_argument("--extent-bytes", help="size of one shared-memory extent (default 64MiB)")
    s.add_argument("--aux-bytes", help="budget for the non-KV state of all sequences (default 256MiB)")
    s.add_argument("--aux-bytes-per-sequence", help="the most non-KV state one sequence may hold (default 16MiB)")
    s.add_argument(
        "--enable-prefix-reuse",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share identical full prefix pages between sequences (off by default; "
        "--no-enable-prefix-reuse overrides a config file)",
    )
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (default: off)")
    s.add_argument("--metrics-host", help="address of the metrics endpoint (default 127.0.0.1)")
    s.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    s.add_argument(
        "--events-endpoint",
        help="publish KV events in vLLM's format on this ZMQ endpoint, e.g. tcp://*:5557 (default: off)",
    )
    s.add_argument("--events-replay-endpoint", help="ZMQ endpoint answering replay requests for missed events")
    for key, text in _REMOTE_FLAGS.items():
        s.add_argument(f"--remote-{key.replace('_', '-')}", dest=f"remote_{key}", help=text)
    for key, text in _DISK_FLAGS.items():
        s.add_argument(f"--disk-{key.replace('_', '-')}", dest=f"disk_{key}", help=text)


def parser() -> argparse.ArgumentParser:
    from kvd import __version__

    p = argparse.ArgumentParser(prog="kvd", description="host KV-cache daemon for LLM inference")
    p.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    _common_options(s)
    _serve_options(s)
    s.set_defaults(func=_serve)

    st = sub.add_parser("stats", help="print the daemon's page statistics")
    _common_options(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--watch", type=float, nargs="?", const=1.0, help="refresh every N seconds (default 1)")
    st.set_defaults(func=_stats)

    v = sub.add_parser("verify", help="check every published page against its checksum; drop corrupted ones")
    _common_options(v)
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=_verify)

    r = sub.add_parser("reset", help="drop cached (unreferenced) published pages, as after a weight update")
    _common_options(r)
    r.add_argument("--namespace", type=int, help="only this namespace id (default: every namespace)")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=_reset)

    c = sub.add_parser("clean", help="remove shared memory a stopped daemon left behind")
    _common_options(c)
    c.set_defaults(func=_clean)

    h = sub.add_parser("health", help="print the daemon's gRPC health; exit 0 only when SERVING (a readiness probe)")
    _common_options(h)
    h.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default 2)")
    h.set_defaults(func=_health)

    d = sub.add_parser("doctor", add_help=False, help="check, where an engine runs, everything it needs from kvd")
    d.set_defaults(func=_doctor, parser=d, passes_on=True)  # every option goes to engine_client/doctor.py
    return p


def main(argv: list[str] | None = None) -> int:
    args, unknown = parser().parse_known_args(argv)
    if getattr(args, "passes_on", False):
        args.passed_on = unknown
    elif unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # exits 2
    try:
        return args.func(args)
    except config_mod.ConfigError as e:
        print(f"kvd: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvd stats | head`: the reader had enough, which is no failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
