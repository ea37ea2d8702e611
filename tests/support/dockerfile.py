"""deploy/Dockerfile read as its stages and instructions, and what the final image runs
(its user, environment and default command): for the image tests of both tiers."""
from __future__ import annotations

import json
import os
import shlex

from helpers import REPO_ROOT

DOCKERFILE = os.path.join(REPO_ROOT, "deploy", "Dockerfile")
IMAGE_DIRS = os.path.join(REPO_ROOT, "deploy", "image-dirs.sh")


def dockerfile_stages():
    """[(FROM argument, [(INSTRUCTION, argument), ...]), ...] of deploy/Dockerfile."""
    with open(DOCKERFILE) as f:
        lines = [ln.strip() for ln in f.read().replace("\\\n", " ").splitlines()
                 if ln.strip() and not ln.lstrip().startswith("#")]
    stages = []
    for ln in lines:
        kind, arg = ln.split(None, 1)
        if kind == "FROM":
            stages.append((arg, []))
        else:
            stages[-1][1].append((kind, arg))
    return stages


def final_stage():
    by_kind: dict[str, list[str]] = {}
    for kind, arg in dockerfile_stages()[-1][1]:
        by_kind.setdefault(kind, []).append(arg)
    return by_kind


def image_env():
    env = {}
    for arg in final_stage()["ENV"]:
        for item in shlex.split(arg):
            key, value = item.split("=", 1)
            env[key] = value
    return env


def default_command():
    by_kind = final_stage()
    return json.loads(by_kind["ENTRYPOINT"][-1]) + json.loads(by_kind["CMD"][-1])
