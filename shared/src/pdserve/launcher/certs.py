"""`pdserve certs`: a cluster CA and per-service certificates (also `pdserve up`'s throwaway set).

    pdserve certs init  --dir DIR                       # DIR/ca.crt, DIR/ca.key
    pdserve certs issue --dir DIR --role prefill --instance-id prefill-a --host 10.0.0.2
                                                        # DIR/prefill-a.crt, DIR/prefill-a.key

A service is then started with ``--tls-ca DIR/ca.crt --tls-cert DIR/<id>.crt --tls-key
DIR/<id>.key``; its role and instance id are the certificate's. Keep ``ca.key`` off the
serving machines: only ``ca.crt`` and each service's own pair travel there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.common import pki


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds ``certs init`` and ``certs issue`` to the ``pdserve`` command."""
    certs = commands.add_parser(
        "certs",
        help="make a cluster CA and per-service certificates for mutual TLS",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = certs.add_subparsers(dest="certs_command", required=True)
    init = actions.add_parser("init", help="create a new cluster CA (ca.crt, ca.key)")
    init.add_argument("--dir", required=True, type=Path, help="directory for ca.crt and ca.key")
    init.add_argument("--days", type=int, default=pki.DEFAULT_DAYS, help="validity in days")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    issue = actions.add_parser("issue", help="issue one service's certificate from the CA")
    issue.add_argument("--dir", required=True, type=Path, help="directory holding the CA")
    issue.add_argument("--role", required=True, choices=pki.ROLES, help="the service's role")
    issue.add_argument(
        "--instance-id",
        required=True,
        help="the service's instance id (a DNS label: lower-case letters, digits, hyphens)",
    )
    issue.add_argument(
        "--host",
        action="append",
        default=[],
        help="a DNS name or IP of the machine, for tools that verify by address (repeatable)",
    )
    issue.add_argument("--days", type=int, default=pki.DEFAULT_DAYS, help="validity in days")
    issue.add_argument("--out", type=Path, help="where to write the pair (default: --dir)")


def run(args: argparse.Namespace) -> int:
    """Runs ``pdserve certs ...``; prints what it wrote."""
    directory: Path = args.dir
    try:
        if args.certs_command == "init":
            if (directory / "ca.key").exists() and not args.force:
                raise ValueError(f"{directory / 'ca.key'} exists (pass --force to replace it)")
            pki.write_ca(directory, pki.new_ca(days=args.days))
            print(directory / "ca.crt")
            return 0
        identity = pki.Identity(args.role, args.instance_id)
        ca = pki.read_ca(directory)
        pair = pki.issue(ca, identity, tuple(args.host), days=args.days)
        files = pki.write_identity(args.out or directory, ca, pair, identity.instance_id)
    except (ValueError, OSError) as error:
        print(f"pdserve certs: {error}", file=sys.stderr)
        return 1
    print(f"{files.cert}\n{files.key}")
    print(
        f"start it with: --tls-ca {files.ca} --tls-cert {files.cert} --tls-key {files.key}",
        file=sys.stderr,
    )
    return 0


def throwaway(directory: Path, identities: list[pki.Identity]) -> dict[str, pki.TlsFiles]:
    """A fresh CA and one certificate per identity in `directory` (for `pdserve up`).

    Returns:
        The files of each identity, by instance id. The CA's key is not kept.
    """
    ca = pki.new_ca(name="pdserve up (throwaway) CA", days=30)
    return {
        identity.instance_id: pki.write_identity(
            directory, ca, pki.issue(ca, identity, days=30), identity.instance_id
        )
        for identity in identities
    }
