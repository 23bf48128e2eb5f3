"""Images for sandboxes: build an app's image from its build context, or check a reference.

Synchronous Docker SDK calls; callers offload them (`asyncio.to_thread`).
Build progress goes to a callback, one line at a time, so a CLI can show it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import docker
import docker.errors

from cellgate.errors import EngineUnavailable, ImageError

Progress = Callable[[str], None]


def docker_client() -> Any:
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        raise EngineUnavailable(str(exc)) from exc
    return client


def image_exists(client: Any, ref: str) -> bool:
    try:
        client.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    except docker.errors.APIError as exc:
        raise ImageError(ref, f"the engine failed to look it up: {exc.explanation}") from exc
    return True


def image_id(client: Any, ref: str) -> str:
    try:
        return str(client.images.get(ref).id)
    except docker.errors.ImageNotFound as exc:
        raise ImageError(
            ref, "not present on this engine; build it or `docker pull` it first"
        ) from exc
    except docker.errors.APIError as exc:
        raise ImageError(ref, f"the engine failed to look it up: {exc.explanation}") from exc


def build_image(
    client: Any,
    context: Path,
    dockerfile: str,
    tag: str,
    buildargs: Mapping[str, str],
    progress: Progress,
) -> str:
    """Build `tag` from `context`; return the image id. Each build step is reported."""
    if not (context / dockerfile).is_file():
        raise ImageError(tag, f"no {dockerfile} in build context {context}")
    image: str | None = None
    try:
        stream = client.api.build(
            path=str(context),
            dockerfile=dockerfile,
            tag=tag,
            buildargs=dict(buildargs),
            rm=True,
            forcerm=True,
            decode=True,
        )
        for chunk in stream:
            if "error" in chunk:
                raise ImageError(tag, f"build failed: {str(chunk['error']).strip()}")
            line = str(chunk.get("stream", "")).strip()
            if line:
                progress(line)
            aux = chunk.get("aux")
            if isinstance(aux, dict) and "ID" in aux:
                image = str(aux["ID"])
    except docker.errors.APIError as exc:
        raise ImageError(tag, f"build failed: {exc.explanation}") from exc
    except json.JSONDecodeError as exc:
        raise ImageError(tag, f"the engine sent an unreadable build stream: {exc}") from exc
    return image or image_id(client, tag)
