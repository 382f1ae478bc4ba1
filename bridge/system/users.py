"""Identities and Unix users: the mapping file, the admins, the users' Slurm accounts.

The API turns an authenticated identity into the Unix user who owns a task; the poller reads the
same mapping for a user's default Slurm account. Both sides need it, so it lives here, apart from
the authenticators (``bridge.api.auth``), and the poller never imports the API.
"""

from __future__ import annotations

import grp
import pwd
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: POSIX-portable user names (what useradd accepts by default on Debian), without `$`.
UNIX_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
#: Slurm account names as sbatch takes them on the command line.
SLURM_ACCOUNT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class UnknownUser(Exception):
    """An identity that maps to no allowed Unix user; the message is for the log only."""


@dataclass(frozen=True)
class MappedUser:
    user: str
    #: Default Slurm account for this user's jobs (None: Slurm's default for the user).
    account: str | None = None


class UserMap:
    """Identity -> Unix user (and default Slurm account).

    The mapping file is TOML::

        [users]
        "alice@example.org" = "alice"                          # identity = Unix user
        "bob@example.org" = { user = "bob", account = "lab-b" }

    With a file, an identity that is not in it is refused. Without one, the identity itself is
    the Unix user name and must look like one. With `require_local` (site mode) the user must
    also exist on this host, since jobs will run under that account.
    """

    def __init__(
        self, entries: dict[str, MappedUser] | None = None, *, require_local: bool = False
    ):
        self.entries = entries
        self.require_local = require_local

    @classmethod
    def load(cls, path: Path | None, *, require_local: bool = False) -> UserMap:
        if path is None:
            return cls(None, require_local=require_local)
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
        entries: dict[str, MappedUser] = {}
        for identity, value in (data.get("users") or {}).items():
            if isinstance(value, str):
                mapped = MappedUser(value)
            elif isinstance(value, dict) and isinstance(value.get("user"), str):
                mapped = MappedUser(value["user"], value.get("account"))
            else:
                raise ValueError(f"{path}: users.{identity}: expected a user name or a table")
            if not UNIX_USER.fullmatch(mapped.user):
                raise ValueError(f"{path}: users.{identity}: {mapped.user!r} is not a user name")
            if mapped.account is not None and not SLURM_ACCOUNT.fullmatch(mapped.account):
                raise ValueError(f"{path}: users.{identity}: invalid account {mapped.account!r}")
            entries[identity] = mapped
        return cls(entries, require_local=require_local)

    def resolve(self, identity: str) -> MappedUser:
        if self.entries is not None:
            mapped = self.entries.get(identity)
            if mapped is None:
                raise UnknownUser(f"identity {identity!r} is not in the user mapping file")
        elif UNIX_USER.fullmatch(identity):
            mapped = MappedUser(identity)
        else:
            raise UnknownUser(f"identity {identity!r} is not a valid Unix user name")
        if self.require_local:
            try:
                entry = pwd.getpwnam(mapped.user)
            except KeyError:
                raise UnknownUser(f"user {mapped.user!r} does not exist on this host") from None
            if entry.pw_uid == 0:
                raise UnknownUser("tasks never run as root")
        return mapped

    def account_for(self, user: str) -> str | None:
        """The default Slurm account of a Unix user (the first mapping entry that names one)."""
        for mapped in (self.entries or {}).values():
            if mapped.user == user and mapped.account:
                return mapped.account
        return None


class AdminPolicy:
    """Admins see and cancel every task: listed users and members of a Unix group."""

    def __init__(self, users: Iterable[str] = (), group: str | None = None):
        self.users = frozenset(users)
        self.group = group

    def is_admin(self, user: str) -> bool:
        if user in self.users:
            return True
        if not self.group:
            return False
        try:
            group = grp.getgrnam(self.group)
        except KeyError:
            return False
        if user in group.gr_mem:
            return True
        try:
            return pwd.getpwnam(user).pw_gid == group.gr_gid
        except KeyError:
            return False
