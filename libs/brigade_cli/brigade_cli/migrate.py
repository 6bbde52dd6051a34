"""`brigade migrate-keys`: move a Redis of the key layout before hash tags to the current one
(`brigade.store.migrate`)."""

from __future__ import annotations

import asyncio

import typer

from brigade.settings import REDIS_URL, RedisUrl


def migrate_keys(
    redis_url: RedisUrl = REDIS_URL.default,
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would move; change nothing."),
) -> None:
    """Move runs stored before hash tags (brigade:<run>:*) to brigade:{<run>}:*, in place.

    Stop every brigade service first (a janitor holding its lock is refused). Run it again after an
    interruption: it finishes what is left. Exit 0 when done (or nothing to do), 1 on conflicts.
    """
    from brigade.redis_clients import async_client, is_cluster
    from brigade.store.migrate import migrate_keys as migrate

    if is_cluster(redis_url):
        typer.echo("brigade migrate-keys: a Redis Cluster never held the old layout (its scripts could not run "
                   "there); migrate the single Redis it came from, then copy with `redis-cli --cluster import`",
                   err=True)
        raise typer.Exit(2)

    async def main() -> int:
        from brigade import keys

        redis = async_client(redis_url, 4)
        try:
            holder = await redis.get(keys.JANITOR_LOCK)
            if holder and not dry_run:
                typer.echo(f"brigade migrate-keys: a janitor holds the lock ({holder.decode(errors='replace')}); "
                           "stop every brigade service (proxies, janitors, evaluators) first", err=True)
                return 2
            done = await migrate(redis, dry_run=dry_run, progress=typer.echo)
        finally:
            await redis.aclose()
        verb = "would move" if dry_run else "moved"
        typer.echo(f"{len(done.runs)} run(s), {done.keys_moved} key(s) {verb}"
                   + (f"; {len(done.skipped)} invalid run id(s) left as they are" if done.skipped else ""))
        for key in done.conflicts:
            typer.echo(f"conflict: {key} was not moved, its new name already exists", err=True)
        return 1 if done.conflicts else 0

    raise typer.Exit(asyncio.run(main()))
