"""Deploy across machines: certificates, node keys, SuperLink, SuperNodes, the CLI connection.

Usage (each host runs its part; see docs/deployment.md):

    python -m tools.deploy certs --out certs --name superlink.example.org --ip 10.0.0.5
    python -m tools.deploy keys --out keys --nodes 3
    python -m tools.deploy superlink --certs certs --auth --host 127.0.0.1 --port 8001 [--database state.db]
    python -m tools.deploy proxy --certs certs --listen 0.0.0.0:8000 --superlink 127.0.0.1:8001 \\
        --operator 10.0.0.9                                   # Control API for the CLI host only
    python -m tools.deploy connection --address 10.0.0.5:8000 --root-cert certs/ca.crt [--name deploy]
    python -m tools.deploy register --connection deploy keys/node-*.pub   # from the CLI host
    python -m tools.deploy supernode --superlink 10.0.0.5:8000 --root-cert certs/ca.crt \\
        --key keys/node-0 --partition-id 0 --num-partitions 3 --data-dir /data --state-dir /var/lib/mhfl
    flwr run . deploy --run-config "method='fedgh' num-clients=3 data-dir='/data'" --stream

``superlink``/``supernode``/``proxy`` print the exact command and then replace this process with
it (``exec``), so a service manager supervises Flower itself; ``supernode`` first starts the
node's SuperExec (:mod:`tools.superexec`, warm ClientApp processes), which exits with the node.
TLS is the default; ``--insecure`` is an explicit opt-in for a local test and cannot be combined
with ``--auth`` (Flower's node authentication needs TLS).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

#: the Flower CLIs live next to this interpreter (the project's virtual environment)
BIN = Path(sys.executable).parent


def write_certificates(
    out: Path, names: list[str], ips: list[str], days: int = 365, ca_key_dir: Path | None = None
) -> dict[str, Path]:
    """A CA and a SuperLink server certificate signed by it, valid for ``names`` and ``ips``.

    The server certificate's subjectAltName lists every DNS name and IP address clients use to
    reach the SuperLink (SuperNodes and the ``flwr`` CLI check it); ``localhost`` and
    ``127.0.0.1`` are always included. Keys are ECDSA P-384, written with mode 0600. The CA key
    goes to ``ca_key_dir`` (default ``<out>-ca``), apart from the files that are copied to
    hosts: whoever holds it can impersonate the SuperLink.

    Returns:
        ``{"ca": <out>/ca.crt, "ca-key": <ca_key_dir>/ca.key, "cert": <out>/server.pem,
        "key": <out>/server.key}``.

    Raises:
        ValueError: an entry of ``ips`` is not an IP address.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, server_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mheterofl-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    dns = list(dict.fromkeys(["localhost", *names]))
    addresses = list(dict.fromkeys(["127.0.0.1", *ips]))
    san = x509.SubjectAlternativeName(
        [*(x509.DNSName(n) for n in dns), *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses)]
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns[-1])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(san, critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_key_dir = ca_key_dir or out.with_name(out.name + "-ca")
    ca_key_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = {
        "ca": out / "ca.crt",
        "ca-key": ca_key_dir / "ca.key",
        "cert": out / "server.pem",
        "key": out / "server.key",
    }
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    for name, key in (("ca-key", ca_key), ("key", server_key)):
        _write_secret(
            paths[name],
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )
    return paths


def write_node_keys(out: Path, count: int, first: int = 0) -> list[tuple[Path, Path]]:
    """ECDSA P-384 key pairs ``node-<i>`` (OpenSSH private key, 0600) and ``node-<i>.pub`` (OpenSSH
    public key), the format ``flwr supernode register`` and ``--auth-supernode-private-key`` take
    (what ``ssh-keygen -t ecdsa -b 384`` writes). Returns ``[(private, public), ...]``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for i in range(first, first + count):
        key = ec.generate_private_key(ec.SECP384R1())
        private, public = out / f"node-{i}", out / f"node-{i}.pub"
        _write_secret(
            private,
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            ),
        )
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
        )
        pairs.append((private, public))
    return pairs


def superlink_command(
    certs: Path | None, auth: bool, host: str = "0.0.0.0", port: int = 8000, database: str | None = None
) -> list[str]:
    """``flower-superlink`` for deployment: TLS with ``certs`` (None: insecure), node authentication
    with ``auth``, runtime dependency installation off (the app's dependencies are preinstalled).

    Raises:
        ValueError: ``auth`` without certificates (Flower requires TLS for node authentication).
    """
    if auth and certs is None:
        raise ValueError("--auth needs TLS: pass --certs (SuperNode authentication is refused without TLS)")
    cmd = [
        str(BIN / "flower-superlink"),
        "--host",
        host,
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
    ]
    cmd += (
        [
            "--ssl-ca-certfile",
            str(certs / "ca.crt"),
            "--ssl-certfile",
            str(certs / "server.pem"),
            "--ssl-keyfile",
            str(certs / "server.key"),
        ]
        if certs
        else ["--insecure"]
    )
    cmd += ["--enable-supernode-auth"] if auth else []
    cmd += ["--database", database] if database else []
    return cmd


def node_config(
    partition_id: int, num_partitions: int, data_dir: str | None = None, state_dir: str | None = None
) -> str:
    """The ``--node-config`` string: partition, and optionally where the data and the client state live."""
    items = {
        "partition-id": partition_id,
        "num-partitions": num_partitions,
        "data-dir": data_dir,
        "state-dir": state_dir,
    }
    return " ".join(f"{k}={v}" if isinstance(v, int) else f'{k}="{v}"' for k, v in items.items() if v is not None)


def supernode_command(
    superlink: str,
    root_cert: Path | None,
    key: Path | None,
    config: str,
    port: int = 9094,
    max_retries: int | None = None,
) -> list[str]:
    """``flower-supernode`` connecting to ``superlink`` (host:port) over TLS trusting ``root_cert``
    (None: insecure), authenticating with the private ``key`` when given; ``port`` is its local
    runtime API port (one per SuperNode on a host). Process isolation: its ClientApps are started
    by the SuperExec of :func:`superexec_command`, which the caller starts beside it."""
    cmd = [str(BIN / "flower-supernode"), "--superlink", superlink, "--node-config", config, "--port", str(port)]
    cmd += ["--isolation", "process"]
    cmd += ["--root-certificates", str(root_cert)] if root_cert else ["--insecure"]
    cmd += ["--auth-supernode-private-key", str(key)] if key else []
    cmd += ["--max-retries", str(max_retries)] if max_retries is not None else []
    return cmd


def superexec_command(port: int, parent_pid: int) -> list[str]:
    """The SuperExec of the SuperNode whose runtime API is ``127.0.0.1:port``: :mod:`tools.superexec`,
    whose ClientApp processes fork from a process with Flower and torch already imported; it exits
    when process ``parent_pid`` (the SuperNode) does."""
    return [
        sys.executable,
        str(Path(__file__).with_name("superexec.py")),
        "--runtime-api-address",
        f"127.0.0.1:{port}",
        "--insecure",
        "--parent-pid",
        str(parent_pid),
    ]


#: path prefixes of Flower 1.42's SuperLink HTTP APIs, which all share one port
#: (flwr/superlink/routers/fleet, flwr/superlink/routers/control, flwr/supercore/routers/runtime)
FLEET_PATH, CONTROL_PATH, RUNTIME_PATH = "/v1/fleet/", "/v1/control/", "/v1/runtime/"


def proxy_config(folder: Path, certs: Path, listen: str, superlink: str, operators: list[str]) -> Path:
    """An nginx configuration that puts the SuperLink behind a TLS reverse proxy: the Fleet API
    (SuperNodes) and ``/health`` from anywhere, the Control API (``flwr run/stop/list/supernode``)
    only from the ``operators`` addresses or networks, everything else (the Runtime API of
    ServerApps, which reach the SuperLink on loopback directly) from nowhere.

    In Flower 1.42 the three APIs share one port and Flower has no per-API access control, so
    without this anyone holding ``ca.crt`` could submit a run (whose ClientApp then runs on every
    SuperNode) or stop the real one. The proxy terminates TLS with the SuperLink's certificate
    and key (so clients keep trusting ``ca.crt``) and forwards over TLS to ``superlink``
    (host:port, a loopback address of the SuperLink's host), verifying its certificate against
    the CA. Streaming (``flwr log --stream``) and large payloads pass unbuffered.

    Returns:
        The path of the written ``nginx.conf`` in ``folder`` (which also receives the pid file,
        logs and nginx's temporary files).

    Raises:
        ValueError: ``operators`` is empty (the Control API would be reachable by no one).
    """
    if not operators:
        raise ValueError("give at least one --operator address (the hosts allowed to use the flwr CLI)")
    folder = folder.absolute()
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (folder / "tmp" / sub).mkdir(parents=True, exist_ok=True)
    certs = certs.absolute()
    allow = "".join(f"            allow {a};\n" for a in operators)
    forward = f"""proxy_pass https://{superlink};
            proxy_ssl_trusted_certificate {certs / "ca.crt"};
            proxy_ssl_verify on;
            proxy_ssl_name localhost;"""
    text = f"""# written by `python -m tools.deploy proxy`: the SuperLink behind a reverse proxy (see its docstring)
worker_processes 1;
pid {folder / "nginx.pid"};
error_log {folder / "error.log"} warn;
events {{}}
http {{
    access_log {folder / "access.log"};
    client_body_temp_path {folder / "tmp/client_body"};
    proxy_temp_path {folder / "tmp/proxy"};
    fastcgi_temp_path {folder / "tmp/fastcgi"};
    uwsgi_temp_path {folder / "tmp/uwsgi"};
    scgi_temp_path {folder / "tmp/scgi"};
    client_max_body_size 0;
    proxy_http_version 1.1;
    proxy_buffering off;
    proxy_request_buffering off;
    proxy_read_timeout 3600s;
    proxy_send_timeout 3600s;
    server {{
        listen {listen} ssl;
        ssl_certificate {certs / "server.pem"};
        ssl_certificate_key {certs / "server.key"};
        location {FLEET_PATH} {{
            {forward}
        }}
        location = /health {{
            {forward}
        }}
        location {CONTROL_PATH} {{
{allow}            deny all;
            {forward}
        }}
        location / {{
            return 403;
        }}
    }}
}}
"""
    path = folder / "nginx.conf"
    path.write_text(text)
    return path


def proxy_command(config: Path) -> list[str]:
    """``nginx`` in the foreground with ``config`` (from :func:`proxy_config`)."""
    return ["nginx", "-c", str(config), "-g", "daemon off;"]


def write_connection(flwr_home: Path, name: str, address: str, root_cert: Path | None) -> Path:
    """Add (or replace) connection ``name`` in ``<flwr_home>/config.toml`` for ``flwr run/supernode/log``."""
    import tomllib

    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    config = tomllib.loads(path.read_text()) if path.is_file() else {}
    links = config.setdefault("superlink", {})
    links.setdefault("default", name)
    links[name] = {
        "address": address,
        **({"root-certificates": str(root_cert.resolve())} if root_cert else {"insecure": True}),
    }
    lines = ["[superlink]", f'default = "{links["default"]}"', ""]
    for key, value in links.items():
        if isinstance(value, dict):
            lines.append(f"[superlink.{key}]")
            lines += [f"{k} = {_toml(v)}" for k, v in value.items()]
            lines.append("")
    path.write_text("\n".join(lines))
    return path


def register_nodes(
    public_keys: list[Path], connection: str, timeout: float = 0.0, env: dict[str, str] | None = None
) -> list[str]:
    """Register each SuperNode public key with the SuperLink of CLI ``connection``
    (``flwr supernode register``), waiting up to ``timeout`` seconds for the SuperLink to answer.
    ``env``: the CLI's environment (default :func:`environment`; ``FLWR_HOME`` finds the connection).

    A key the SuperLink already holds counts as registered, so a restarted stack (whose SuperLink
    kept its database) registers nothing twice. Returns one line per key for the log.

    Raises:
        RuntimeError: a key was refused, or the SuperLink did not answer within ``timeout``.
    """
    lines = []
    for key in public_keys:
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run(
                [str(BIN / "flwr"), "supernode", "register", str(key), connection],
                capture_output=True,
                text=True,
                env=env or environment(),
            )
            said = (done.stdout + done.stderr).strip()
            if done.returncode == 0 or "already in use" in said:
                lines.append(f"{key}: " + ("registered" if done.returncode == 0 else "registered before"))
                break
            if "unavailable" not in said.lower():  # anything but "the SuperLink is not up yet"
                raise RuntimeError(f"registering {key} failed: {said}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the SuperLink of connection '{connection}' did not answer within {timeout:.0f} s: {said}"
                )
            time.sleep(1.0)
    return lines


#: seconds between a SuperExec's looks for a new task (Flower's default 1 s): a deployed message
#: waits for it once to get a ClientApp (or ServerApp) process started
TASK_POLL_SECONDS = 0.1


def environment() -> dict[str, str]:
    """The environment Flower's processes need: this venv's CLIs on PATH (SuperExec, ClientApps),
    no runtime installs, no Hub look-ups, SuperExecs that look for tasks every
    :data:`TASK_POLL_SECONDS` (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``; one already set is kept)."""
    return {
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(TASK_POLL_SECONDS),
        **os.environ,
        "PATH": str(BIN) + os.pathsep + os.environ.get("PATH", ""),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _toml(value) -> str:
    return "true" if value is True else "false" if value is False else f'"{value}"'


def _write_secret(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only: mode 0600 also when the file existed with
    another mode, and never through a symlink (``O_NOFOLLOW``: a link planted at ``path`` is refused).

    Raises:
        OSError: ``path`` is a symlink (ELOOP) or cannot be written.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("certs", help="CA + SuperLink certificate")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", action="append", default=[], help="DNS name clients use for the SuperLink (repeat)")
    p.add_argument("--ip", action="append", default=[], help="IP address clients use for the SuperLink (repeat)")
    p.add_argument("--days", type=int, default=365)
    p.add_argument("--ca-key-dir", type=Path, help="where the CA key goes (default <out>-ca); keep it off the hosts")
    p = sub.add_parser("keys", help="SuperNode authentication key pairs")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--first", type=int, default=0)
    p = sub.add_parser("register", help="register SuperNode public keys with the SuperLink")
    p.add_argument("keys", type=Path, nargs="+", help="public key files (node-<i>.pub)")
    p.add_argument("--connection", default="deploy", help="flwr CLI connection of the SuperLink")
    p.add_argument("--timeout", type=float, default=0.0, help="seconds to wait for the SuperLink to answer")
    p = sub.add_parser("superlink", help="start the SuperLink")
    p.add_argument("--certs", type=Path, help="folder with ca.crt, server.pem, server.key")
    p.add_argument("--insecure", action="store_true", help="no TLS: local tests only")
    p.add_argument("--auth", action="store_true", help="accept only registered SuperNode keys")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--database", help="SQLite file keeping the SuperLink's state (runs, registered nodes)")
    p = sub.add_parser("proxy", help="start the reverse proxy in front of the SuperLink (nginx)")
    p.add_argument("--certs", type=Path, required=True, help="folder with ca.crt, server.pem, server.key")
    p.add_argument("--listen", default="0.0.0.0:8000", help="public address:port (SuperNodes, flwr CLI)")
    p.add_argument("--superlink", default="127.0.0.1:8001", help="the SuperLink's loopback address:port")
    p.add_argument(
        "--operator", action="append", default=[], help="address or network allowed to use the Control API (repeat)"
    )
    p.add_argument("--out", type=Path, default=Path("proxy"), help="folder for nginx.conf, logs, temp files")
    p = sub.add_parser("supernode", help="start a SuperNode")
    p.add_argument("--superlink", required=True, help="host:port of the SuperLink")
    p.add_argument("--root-cert", type=Path, help="the CA certificate (ca.crt)")
    p.add_argument("--insecure", action="store_true", help="no TLS: local tests only")
    p.add_argument("--key", type=Path, help="this node's private key (registered with `flwr supernode register`)")
    p.add_argument("--partition-id", type=int, required=True)
    p.add_argument("--num-partitions", type=int, required=True)
    p.add_argument("--data-dir", help="absolute folder with <dataset>/train.parquet on this host")
    p.add_argument("--state-dir", help="absolute folder where this node persists its client state")
    p.add_argument("--port", type=int, default=9094, help="local runtime API port (distinct per node on a host)")
    p.add_argument("--max-retries", type=int, help="give up after this many failed connections (default: never)")
    p = sub.add_parser("connection", help="write the flwr CLI connection")
    p.add_argument("--address", required=True)
    p.add_argument("--root-cert", type=Path)
    p.add_argument("--name", default="deploy")
    p.add_argument("--flwr-home", type=Path, default=Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr")))
    args = parser.parse_args(argv)

    if args.command == "certs":
        for name, path in write_certificates(args.out, args.name, args.ip, args.days, args.ca_key_dir).items():
            print(f"{name}: {path}")
        return 0
    if args.command == "keys":
        for private, public in write_node_keys(args.out, args.nodes, args.first):
            print(f"{private} {public}")
        return 0
    if args.command == "register":
        try:
            print("\n".join(register_nodes(args.keys, args.connection, args.timeout)), flush=True)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        return 0
    if args.command == "connection":
        print(write_connection(args.flwr_home, args.name, args.address, args.root_cert))
        return 0
    if args.command == "proxy":
        cmd = proxy_command(proxy_config(args.out, args.certs, args.listen, args.superlink, args.operator))
        print(shlex.join(cmd), flush=True)
        os.execvp(cmd[0], cmd)
    if args.command == "superlink":
        if not args.insecure and args.certs is None:
            parser.error("pass --certs (TLS) or, for a local test only, --insecure")
        cmd = superlink_command(None if args.insecure else args.certs, args.auth, args.host, args.port, args.database)
    else:
        if not args.insecure and args.root_cert is None:
            parser.error("pass --root-cert (TLS) or, for a local test only, --insecure")
        config = node_config(args.partition_id, args.num_partitions, args.data_dir, args.state_dir)
        cmd = supernode_command(
            args.superlink, None if args.insecure else args.root_cert, args.key, config, args.port, args.max_retries
        )
        # the SuperExec watches this pid, which the SuperNode keeps after the exec below
        superexec = superexec_command(args.port, os.getpid())
        print(shlex.join(superexec), flush=True)
        subprocess.Popen(superexec, env=environment())
    print(shlex.join(cmd), flush=True)
    os.execve(cmd[0], cmd, environment())
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
