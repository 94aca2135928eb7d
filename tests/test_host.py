"""dspark.utils.host: the glibc malloc thresholds are set once, and left alone when the environment or
DSPARK_MALLOC_TUNING=0 says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECK = ("import dspark.utils.host as h; first = h.tune_malloc(); print(first, h.tune_malloc(), h._done)")


def _run(env_extra: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "DSPARK_MALLOC_TUNING"}
    return subprocess.run([sys.executable, "-c", CHECK], env={**env, **env_extra}, capture_output=True,
                          text=True, check=True).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tune_malloc_sets_the_thresholds_once_unless_told_not_to():
    assert _run({}) == ["True", "True", "True"]
    assert _run({"DSPARK_MALLOC_TUNING": "0"}) == ["False", "False", "False"]
    assert _run({"MALLOC_MMAP_THRESHOLD_": "1048576"}) == ["False", "False", "False"]
