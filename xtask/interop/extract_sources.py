"""Extracts the pure-Python files kvatlas's interop test loads from a vLLM or SGLang wheel.

Usage: extract_sources.py <vllm|sglang> <wheel> <destination directory>

Only the KV-event publisher modules and their light helpers are extracted (docs/events.md §6,
"What is downloaded and loaded"); nothing that imports torch. The destination is recreated from
scratch, so a partial earlier extraction never lingers.
"""

import fnmatch
import shutil
import sys
import zipfile
from pathlib import Path

# The real modules the driver loads, per engine (docs/events.md §6).
PATTERNS = {
    "vllm": [
        "vllm/distributed/kv_events.py",
        "vllm/config/kv_events.py",
        "vllm/envs.py",
        "vllm/logger.py",
        "vllm/logging_utils/*.py",
        "vllm/utils/network_utils.py",
        "vllm/utils/hashing.py",
        "vllm/_version.py",
    ],
    "sglang": [
        "sglang/srt/disaggregation/kv_events.py",
        "sglang/srt/utils/network.py",
    ],
}


def main() -> int:
    if len(sys.argv) != 4 or sys.argv[1] not in PATTERNS:
        print(__doc__, file=sys.stderr)
        return 2
    engine, wheel, dest = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    patterns = PATTERNS[engine]
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    extracted = []
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                archive.extract(name, tmp)
                extracted.append(name)
    # Every pattern without a wildcard must have matched (vllm/_version.py is optional).
    missing = [
        p
        for p in patterns
        if "*" not in p and p not in extracted and not p.endswith("_version.py")
    ]
    if missing:
        print(f"{wheel.name}: missing {missing}", file=sys.stderr)
        return 1
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    print(f"{wheel.name}: extracted {len(extracted)} files into {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
