"""`tes-bridge images list|pull|forget`: the operators' view of the shared image cache."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from bridge.cli.database import init_store
from bridge.config import Config

if TYPE_CHECKING:
    from bridge.images.cache import ImageCache
    from bridge.images.index import Entry


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    images = commands.add_parser(
        "images",
        help="the shared image cache: list, pull or forget images",
        description="The SIF cache the poller fills (container.cache_dir). A tag is checked "
        "against its registry again after container.refresh_seconds and pulled again only when "
        "its manifest digest changed; an @sha256: reference never is. SIFs are named by digest; "
        "one a tag no longer names is removed once no unfinished task can still use it.",
    )
    actions = images.add_subparsers(dest="images_command", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "list", help="references in the cache with their digest, SIF and last check"
    )
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(run=list_images)
    pull = actions.add_parser(
        "pull",
        help="check images against their registry now and pull those that changed",
        description="Check each IMAGE's digest now (whatever container.refresh_seconds says) "
        "and pull it when the cache does not hold that digest yet. Waits for the pulls.",
    )
    pull.add_argument("image", nargs="+", help="image reference as tasks name it, e.g. alpine:3")
    pull.set_defaults(run=pull_images)
    forget = actions.add_parser(
        "forget",
        help="drop images from the cache; the next task that uses one pulls it again",
        description="Drop each IMAGE's entry, then remove the SIFs no entry names any more once "
        "no unfinished task is older than the moment they became unused (the poller also does "
        "this every 10 minutes).",
    )
    forget.add_argument("image", nargs="+", help="image reference as tasks name it")
    forget.set_defaults(run=forget_images)


@contextmanager
def _image_cache(config: Config) -> Iterator[ImageCache]:
    from bridge.images.cache import ImageCache

    cache = ImageCache(config, max_workers=config.container.pull_workers)
    try:
        yield cache
    finally:
        cache.close()


def list_images(config: Config, args: argparse.Namespace) -> int:
    with _image_cache(config) as cache:
        if args.json:
            print(json.dumps([_entry_row(cache, entry) for entry in cache.entries()], indent=2))
            return 0
        print(f"{'REFERENCE':50} {'DIGEST':19} {'CHECKED':20} SIF")
        for entry in cache.entries():
            checked = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.checked_at))
            digest = (entry.digest or "-")[:19]
            print(f"{entry.reference:50} {digest:19} {checked:20} {entry.sif}")
    return 0


def _entry_row(cache: ImageCache, entry: Entry) -> dict[str, Any]:
    """An entry for `list --json`, with its SIF's path and size and its sandbox (None: none)."""
    from bridge.images.index import sandbox_of

    sif = cache.cache_dir / entry.sif
    sandbox = sandbox_of(sif)
    return {
        **entry.__dict__,
        "path": str(sif),
        "size": sif.stat().st_size if sif.is_file() else None,
        "sandbox": str(sandbox) if sandbox.is_dir() else None,
    }


def pull_images(config: Config, args: argparse.Namespace) -> int:
    from bridge.images.ref import ImagePullError

    failed = 0
    with _image_cache(config) as cache:
        for image in args.image:
            try:
                path = cache.pull(image, check=True)
            except ImagePullError as exc:
                print(f"tes-bridge: cannot pull {exc}", file=sys.stderr)
                failed += 1
                continue
            print(f"{image}: {path}")
    return 1 if failed else 0


def forget_images(config: Config, args: argparse.Namespace) -> int:
    """Drop the entries, then remove the SIFs that no unfinished task can still use."""
    from bridge.images.ref import ImagePullError
    from bridge.store import Store

    failed = 0
    with _image_cache(config) as cache:
        for image in args.image:
            try:
                known = cache.forget(image)
            except ImagePullError as exc:
                print(f"tes-bridge: {exc}", file=sys.stderr)
                failed += 1
                continue
            print(f"{image}: {'forgotten' if known else 'not in the cache'}")
        init_store(config)
        store = Store.from_url(config.database_url)
        with store.db.connection_context():
            oldest = store.oldest_unfinished_time()
        deleted, kept = cache.prune(oldest)
    for path in deleted:
        print(f"removed {path}")
    for path in kept:
        print(f"kept {path} (unfinished tasks may still use it; removed later)")
    return 1 if failed else 0
