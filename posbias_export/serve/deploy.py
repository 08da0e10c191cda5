"""The application builder Ray Serve's config files name (`import_path:
posbias_export.serve.deploy:app`, KubeRay's RayService, `serve run`): `args` are `serve`'s options."""
from __future__ import annotations

from .app import build_app, check_origin

NUMBERS = ("replicas", "threads", "max_batch_tokens", "slots", "max_replicas")
OPTIONS = ("folder", *NUMBERS, "allow_origins")


def app(args: dict):
    """args: folder (required), replicas, threads, max_batch_tokens, slots, max_replicas, allow_origins
    (a list) -> the bound application."""
    unknown = sorted(set(args) - set(OPTIONS))
    if unknown or "folder" not in args:
        raise ValueError(f"args take {', '.join(OPTIONS)} (folder required); got {sorted(args)}")
    numbers = {k: int(args[k]) for k in NUMBERS if args.get(k) is not None}
    origins = args.get("allow_origins") or ()
    origins = [check_origin(o) for o in ([origins] if isinstance(origins, str) else origins)]  # as --allow-origin
    return build_app(str(args["folder"]), **numbers, allow_origins=origins)
