"""Identities on a broker (``backroom credentials add | list | remove``) and ``compose-init``.

Both write the files a broker reads (credentials.json, then its password file
and ACL); ``add`` and ``remove`` tell a running broker to reread them (SIGHUP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from backroom.bus.auth import ROLES, CredentialStore
from backroom.cli.common import fail

credentials_app = typer.Typer(
    no_args_is_help=True, help="Identities on a broker: add, list, remove."
)

DirOpt = Annotated[Path, typer.Option("--dir")]
ReloadOpt = Annotated[bool, typer.Option(help="tell a running broker to reread its files (SIGHUP)")]


@credentials_app.command("add")
def credentials_add(
    identity: str,
    directory: DirOpt = Path("runs/broker"),
    role: Annotated[str, typer.Option(help=f"one of {', '.join(ROLES)}")] = "agent",
    reload: ReloadOpt = True,
) -> None:
    """Add an identity while the broker runs; prints its password."""
    store = CredentialStore(directory)
    try:
        cred = store.add(identity, role=role)  # type: ignore[arg-type]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if reload:
        from backroom.bus.broker import reload_broker  # the bus: only when a broker is told

        reload_broker(directory)
    typer.echo(cred.password)


@credentials_app.command("remove")
def credentials_remove(
    identity: str,
    directory: DirOpt = Path("runs/broker"),
    reload: ReloadOpt = True,
) -> None:
    """Remove an identity; a running broker rereads its files and no longer lets it log in."""
    store = CredentialStore(directory)
    if identity not in store.load():
        fail(f"no identity {identity!r} in {store.path}")
    store.remove(identity)
    if reload:
        from backroom.bus.broker import reload_broker  # the bus: only when a broker is told

        reload_broker(directory)
    typer.echo(f"removed {identity}")


@credentials_app.command("list")
def credentials_list(directory: DirOpt = Path("runs/broker")) -> None:
    """The identities a broker knows, one a line: name and role (passwords stay in the file)."""
    for cred in CredentialStore(directory).load().values():
        typer.echo(f"{cred.username}\t{cred.role}")


def compose_init(
    directory: DirOpt = Path("compose/generated"),
    agents: Annotated[str, typer.Option(help="comma-separated agent ids")] = "alice,bob,carol",
    mount: Annotated[
        str, typer.Option(help="where compose mounts DIR in the containers")
    ] = "/backroom",
    port: int = 1883,
) -> None:
    """Generate broker config, passwords, ACL and env files for compose/docker-compose.yml."""
    from backroom.runner.compose import compose_init as write_compose_files

    for path in write_compose_files(
        directory, [a for a in agents.split(",") if a], mount=mount, port=port
    ):
        typer.echo(path)
